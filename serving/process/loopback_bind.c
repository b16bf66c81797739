/* fusionserve's loopback shim (serving/loopback.py builds it and preloads it into a server's local Ray and HAProxy).
 *
 * Wraps libc's bind(): a TCP socket bound to the wildcard address (0.0.0.0, or ::) is bound to loopback instead:
 * 127.0.0.1, or for IPv6 ::ffff:127.0.0.1 when the socket also takes IPv4 (IPV6_V6ONLY off), ::1 when it is IPv6
 * only. Ports listed in FUSIONSERVE_OPEN_PORTS (comma-separated, read once when the library loads) keep the wildcard:
 * the serving ports of `fusionserve serve --host 0.0.0.0`. Explicit addresses, UDP and other families pass unchanged;
 * errno is what the real bind() leaves. Ray's servers (GCS, raylet, core workers) bind every gRPC server on the
 * wildcard with no setting to change it: this is the one place that can. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define MAX_OPEN_PORTS 16

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
static bind_fn real_bind;
static unsigned short open_ports[MAX_OPEN_PORTS];
static int n_open_ports;

__attribute__((constructor)) static void init(void) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *list = getenv("FUSIONSERVE_OPEN_PORTS");
    while (list && *list && n_open_ports < MAX_OPEN_PORTS) {
        char *end;
        unsigned long port = strtoul(list, &end, 10);
        if (end == list) { /* not a number: skip one character (a separator) */
            list++;
            continue;
        }
        if (port > 0 && port < 65536) open_ports[n_open_ports++] = (unsigned short)port;
        list = end;
    }
}

static int kept_open(in_port_t port_be) {
    unsigned short port = ntohs(port_be);
    for (int i = 0; i < n_open_ports; i++)
        if (open_ports[i] == port) return 1;
    return 0;
}

static int is_tcp(int fd) {
    int type = 0;
    socklen_t size = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    int saved = errno;
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (real_bind == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (addr != NULL && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY) && !kept_open(in4.sin_port) && is_tcp(fd)) {
            in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            errno = saved;
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr) && !kept_open(in6.sin6_port) && is_tcp(fd)) {
            int v6only = 0;
            socklen_t size = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size) != 0) v6only = 0;
            if (v6only) {
                in6.sin6_addr = in6addr_loopback;
            } else { /* ::ffff:127.0.0.1: IPv4 clients reach it at 127.0.0.1, as they reached the wildcard */
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                in6.sin6_addr.s6_addr[12] = 127;
                in6.sin6_addr.s6_addr[15] = 1;
            }
            errno = saved;
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    errno = saved;
    return real_bind(fd, addr, len);
}
