"""The converters, one protocol each (base.py): HF GPT-2, Llama, our remote-code model, megatron-core.

    from megatron_zpp.checkpoint.formats import hf
    hf.export_hf(state, config, out)     # our full weights (full_state.py) -> a HF directory
    hf.import_hf(hf_dir, ckpt)           # and back, as a weights-only checkpoint of ours

checkpoint/mcore.py reads and writes megatron-core's directories through formats/mcore.py.
"""

from .base import ConversionError, Format, HFFormat

__all__ = ["ConversionError", "Format", "HFFormat"]
