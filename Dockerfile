# GPU image: NVIDIA's PyTorch container carries CUDA, NCCL, transformer-engine and apex,
# which megatron_zpp uses when present (the start-up log says which kernels ran).
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /workspace/megatron_zpp
COPY pyproject.toml README.md ./
COPY megatron_zpp ./megatron_zpp
# keep the image's torch: install our package and extras without touching it
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir numpy pyyaml tqdm safetensors sentencepiece datasets tensorboard wandb pytest pytest-timeout
COPY . .

# e.g. docker run --gpus all --ipc=host IMAGE torchrun --nproc-per-node 8 pretrain_gpt.py ...
CMD ["python", "pretrain_gpt.py", "--help"]
