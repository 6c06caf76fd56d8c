"""The GPT model, top to bottom.

A stack of pre-norm blocks: token embedding (+ learned absolute positions, Megatron's default;
or RoPE inside attention; or no positions) -> dropout -> [norm -> mixer -> residual, norm -> MLP
-> residual] x L -> final norm -> output layer (tied to the embedding by default) ->
cross-entropy. With --reordered-norms (OLMo 2; OLMo Hybrid's softmax layers) a block normalizes its
branches' outputs instead: [mixer -> norm -> residual, MLP -> norm -> residual]. The mixer of
each layer is causal softmax attention or gated linear attention (config.layer_kind); its MLP is
dense or a mixture of experts (--num-experts, --moe-layer-freq: model/moe_mlp.py). Parallelism
enters only through the layers and one ParallelContext (the TP group and sequence-parallel flag,
the context-parallel group and algorithm: each CP rank holds a contiguous slice of the sequence, at
`ctx.cp_rank`),
and a pipeline stage builds the model with just its layers (`layer_ids`) and the ends it
owns (`pre_process`: embedding, `post_process`: output). Packed documents (model/documents.py)
come as one `documents` object: positions (RoPE's or the learned table's: they restart at each
document with --reset-position-ids), document ids for the mixers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recompute
from ..config import ModelConfig
from ..tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from ..tensor_parallel.layers import ColumnParallelLinear, column_parallel_linear, mark
from .attention import SelfAttention
from .context import ParallelContext
from .documents import Documents
from .dropout import HiddenDropout, site
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .linear_attention import GatedLinearAttention
from .mlp import MLP
from .moe_mlp import MoEMLP
from .norm import build_norm
from .rope import rope_tables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ctx: ParallelContext):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2 * cfg.num_layers)  # residual-branch outputs (GPT-2 / Megatron)
        mixers = {
            "softmax": functools.partial(SelfAttention, layer=layer),  # its probabilities' dropout site: the layer's
            "gla": GatedLinearAttention,
            "gdn": GatedDeltaNet,
            "kda": KimiDeltaAttention,
        }
        mixer = mixers[cfg.layer_kind(layer)]
        norm = _norm_builder(cfg, ctx.sequence_parallel)
        self.norm1 = norm()
        self.mixer = mixer(cfg, ctx, out_std)
        self.mixer_dropout = _dropout(cfg, ctx, site(layer, "mixer"))
        self.norm2 = norm()
        self.mlp = MoEMLP(cfg, layer, ctx, out_std) if cfg.is_moe_layer(layer) else MLP(cfg, ctx, out_std, layer)
        self.mlp_dropout = _dropout(cfg, ctx, site(layer, "mlp"))
        self.reordered = cfg.reordered_norm(layer)  # --reordered-norms: norm1, norm2 act on the branch outputs

    def forward(self, x: torch.Tensor, rope, documents: Documents | None = None) -> torch.Tensor:
        if self.reordered:  # OLMo 2: x + norm(mixer(x)), x + norm(mlp(x))
            x = x + self.mixer_dropout(self.norm1(self.mixer(x, rope, documents)))
            return x + self.mlp_dropout(self.norm2(self.mlp(x)))
        x = x + self.mixer_dropout(self.mixer(self.norm1(x), rope, documents))
        x = x + self.mlp_dropout(self.mlp(self.norm2(x)))
        return x


def describe_block(cfg: ModelConfig) -> str:
    """The start-up log's words for the block Megatron's model flags build (its defaults: LayerNorm, gelu,
    learned absolute positions, linear biases)."""
    positions = {"learned_absolute": "learned absolute positions", "rope": "RoPE", "none": "no positions"}
    bias = "linear biases" if cfg.add_bias_linear else "qkv bias only" if cfg.add_qkv_bias else "no linear biases"
    one_p = " (1p)" if cfg.apply_layernorm_1p else ""
    return f"{cfg.normalization}{one_p}, {cfg.activation}, {positions[cfg.position_embedding_type]}, {bias}"


class PositionEmbedding(nn.Module):
    """Megatron's learned absolute positions: a [max positions, hidden] table, normal(init std), replicated
    over TP; under sequence parallelism each rank adds the rows of its own tokens (a partial gradient)."""

    def __init__(self, max_positions: int, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.weight = mark(
            nn.Parameter(torch.empty(max_positions, cfg.hidden_size)),
            ("normal", cfg.init_method_std),
            tp_partial_grad=sequence_parallel,
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


def _norm_builder(cfg: ModelConfig, sequence_parallel: bool):
    return lambda: build_norm(
        cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, sequence_parallel, cfg.apply_layernorm_1p
    )


def _dropout(cfg: ModelConfig, ctx: ParallelContext, dropout_site: int) -> nn.Module:
    """--hidden-dropout at one site: masks keyed on the elements' places in the global batch (model/dropout.py)."""
    return HiddenDropout(cfg.hidden_dropout, dropout_site, ctx, cfg.dropout_masks)


@dataclass(frozen=True)
class GPTParts:
    """What one model chunk is made of, in forward order (`GPT.parts`): the engines, the estimator
    and the simulator walk this instead of probing the chunk's attributes."""

    embedding: nn.Module | None  # the word embedding: the first stage's, or the last stage's tied copy
    position_embeddings: nn.Module | None  # learned absolute positions (first stage only)
    layers: list[tuple[str, Block]]  # (layer id, block), in order
    final_norm: nn.Module | None  # the last stage's
    output: nn.Module | None  # the untied output layer (a tied one is `embedding`)
    tied: bool  # the output layer is the word embedding
    pre_process: bool
    post_process: bool

    @property
    def tied_embedding(self) -> nn.Module | None:
        """The embedding whose gradient the first and last stages sum (a tied embedding), or None."""
        return self.embedding if self.tied else None


class GPT(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        ctx: ParallelContext = ParallelContext(),
        layer_ids=None,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not cfg.untie_embeddings_and_output_weights
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        sp, std = ctx.sequence_parallel, cfg.init_method_std

        if pre_process or (post_process and self.tied):  # the last stage keeps a copy of a tied embedding
            self.embedding = VocabParallelEmbedding(vocab_size, cfg.hidden_size, ctx.tp, std, sp)
            self.embedding.weight.pipeline_duplicate = not pre_process  # the first stage's copy is the one counted
        self.position_embeddings = None
        if pre_process and cfg.position_embedding_type == "learned_absolute":
            # replicated over TP; under SP each rank adds the rows of its own tokens: a partial gradient
            self.position_embeddings = PositionEmbedding(cfg.max_position_embeddings or cfg.seq_length, cfg, sp)
        if pre_process:
            self.embedding_dropout = _dropout(cfg, ctx, site(0, "embedding"))
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, ctx) for i in layer_ids})
        self.block_groups = recompute.layer_groups(cfg, len(self.layers))  # --recompute-granularity full
        if post_process:
            self.final_norm = _norm_builder(cfg, sp)()
            if not self.tied:
                self.output = ColumnParallelLinear(cfg.hidden_size, vocab_size, ctx.tp, std, sp)

    def parts(self) -> GPTParts:
        """This chunk's parts, by the rule `__init__` builds them with (the one place that knows it)."""
        has_embedding = self.pre_process or (self.post_process and self.tied)
        return GPTParts(
            embedding=self.embedding if has_embedding else None,
            position_embeddings=self.position_embeddings,
            layers=list(self.layers.items()),
            final_norm=self.final_norm if self.post_process else None,
            output=self.output if self.post_process and not self.tied else None,
            tied=self.tied,
            pre_process=self.pre_process,
            post_process=self.post_process,
        )

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] (first stage) or hidden [B, T', H] (later stages; T' = T/TP under
        sequence parallelism). Returns per-token losses [B, T] when labels are given,
        logits (vocab-sharded over TP) on the last stage otherwise, else hidden states."""
        seq_len = (
            tokens.shape[1]
            if tokens is not None
            else hidden.shape[1] * (self.ctx.tp_size if self.ctx.sequence_parallel else 1)
        )
        device = (tokens if tokens is not None else hidden).device
        if documents is not None and documents.positions is not None:
            positions = documents.positions  # [B, T]: restarting at each document
        else:
            start = self.ctx.cp_rank * seq_len  # this CP rank's contiguous slice of the sequence
            positions = torch.arange(start, start + seq_len, device=device)
        x = self.embed(tokens, positions) if self.pre_process else hidden
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rope_tables(self.cfg.rotary_dim, positions, self.cfg.rotary_base)

        blocks = list(self.layers.values())
        for start, stop, again in self.block_groups:  # a recomputed group keeps only its input for the backward
            x = recompute.run_blocks(blocks[start:stop], x, rope, documents, recompute=again)
        if not self.post_process:
            return x
        return self.head(x, labels)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Word embedding (+ the learned positions' rows) -> hidden dropout: [B, T, H], or this TP rank's
        sequence shard [B, T/TP, H] under sequence parallelism (positions [T] or [B, T] of the whole
        local sequence: the shard adds its own slice of them)."""
        x = self.embedding(tokens)
        if self.position_embeddings is not None:
            if self.ctx.sequence_parallel and self.ctx.tp_size > 1:
                n = x.shape[1]
                positions = positions[..., self.ctx.tp.rank * n : (self.ctx.tp.rank + 1) * n]
            x = x + self.position_embeddings(positions)
        return self.embedding_dropout(x)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm -> output layer -> per-token losses (logits, vocab-sharded over TP, without labels)."""
        x = self.final_norm(x)
        weight = self.embedding.weight if self.tied else self.output.weight
        logits = column_parallel_linear(x, weight, self.ctx.tp, self.ctx.sequence_parallel)
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the logits are head()'s temporary (F.linear's backward keeps its inputs, not its output)
        return vocab_parallel_cross_entropy(logits, labels, self.ctx.tp, inplace_backward=True)
