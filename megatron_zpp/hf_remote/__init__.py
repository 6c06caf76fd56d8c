"""Hugging Face remote code for GLA and hybrid models (tools/convert_checkpoint.py --to hf).

The two files here are not imported by megatron_zpp: the exporter copies them next to the
weights, and `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads them
through config.json's auto_map. They are plain PyTorch + transformers and cannot import
megatron_zpp (a user of the exported model does not have it installed)."""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))
MODEL_TYPE = "megatron_zpp_gla"
ARCHITECTURE = "MegatronZppGLAForCausalLM"
CONFIG_FILE, MODELING_FILE = "configuration_megatron_zpp_gla.py", "modeling_megatron_zpp_gla.py"
AUTO_MAP = {
    "AutoConfig": "configuration_megatron_zpp_gla.MegatronZppGLAConfig",
    "AutoModelForCausalLM": f"modeling_megatron_zpp_gla.{ARCHITECTURE}",
}


def files() -> list[str]:
    """Paths of the remote-code files to copy next to the exported weights."""
    return [os.path.join(DIR, CONFIG_FILE), os.path.join(DIR, MODELING_FILE)]
