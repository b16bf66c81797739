# Serving image: the runtime half only (onnxruntime, tokenizers, Ray Serve), no torch.
# Completed by the serving issue; for now it installs the package and runs the CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fusionserve ./fusionserve
COPY export ./export
COPY serving ./serving
RUN pip install --no-cache-dir ".[serve]"
ENTRYPOINT ["fusionserve"]
CMD ["--help"]
