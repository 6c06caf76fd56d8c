# GPU image: NVIDIA's PyTorch container (CUDA, NCCL, its own torch build). Build from the
# repository root (.dockerignore keeps .venv/, data, runs and .git out of the context):
#   docker build -t megatron-zpp .
#   docker run --gpus all --ipc=host megatron-zpp torchrun --nproc-per-node 8 pretrain_gpt.py ...
# The image's torch stays: the packages of its torch stack are pinned to the versions the image
# has (constraints below, on top of the image's own PIP_CONSTRAINT), so our extras can neither
# upgrade nor replace them: pip fails instead. tests/test_docker.py checks these rules.
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /workspace/megatron_zpp
RUN python -c "import torch; print(torch.__version__)" > /tmp/torch_version \
 && python -m pip list --format=freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|numpy|transformer[-_]engine|apex|flash[-_]attn|nvidia-[a-z0-9-]+)==' \
    > /etc/pip-image-constraints.txt \
 && grep -qi '^torch==' /etc/pip-image-constraints.txt
COPY pyproject.toml README.md ./
COPY megatron_zpp ./megatron_zpp
# our package without its dependencies (they name torch), then its dependencies and extras (data,
# logging, dev: pyproject.toml) but torch and triton, within the image's pins
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir -c /etc/pip-image-constraints.txt \
      numpy pyyaml tqdm "safetensors>=0.4" "sentencepiece>=0.2" "datasets>=3" zstandard tensorboard wandb \
      "transformers>=5.24" "fla-core==0.6.0" "pytest>=8" pytest-timeout "pytest-xdist>=3.8" \
 && test "$(python -c 'import torch; print(torch.__version__)')" = "$(cat /tmp/torch_version)" \
 && python -c "import megatron_zpp, transformers, fla; print('transformers', transformers.__version__)"
COPY . .

CMD ["python", "pretrain_gpt.py", "--help"]
