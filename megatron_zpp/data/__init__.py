"""Data: tokenizers, Megatron .bin/.idx datasets, GPT and blended datasets, mock data, the loader."""
