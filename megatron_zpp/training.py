"""Set up a run and train: the loop, evaluation, throughput/MFU and logging.

    cfg -> distributed init -> topology groups -> tokenizer -> model (init from the
    single-rank weights) -> optimizer -> data -> steps

With --load, setup restores the checkpoint (model, optimizer, RNG, iteration, data
position) before the data iterator is built; with --save, train saves every
--save-interval steps and after the last one.

One step: forward/backward over the micro-batches (schedule), average gradients over
data parallel, clip by the global norm, AdamW on fp32 masters, log.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config, qgz_tiers, zero_topology
from .data.loader import BatchIterator
from .logging_utils import MetricsSink, log
from .model import GPT, count_parameters, init_weights
from .ops.norm import backend as norm_backend
from .optim import learning_rate
from .perf import flops_per_token, memory_gib, peak_tflops
from .pipeline_parallel import StageLink, run_schedule, stage_layers, virtual_stage_layers
from .tensor_parallel.mappings import gather_from_tp
from .tensor_parallel.random import seed_parallel_rng
from .topology import ProcessGroups, build_groups
from .zero import PlainDP, ZeroDP


@dataclass
class Run:
    cfg: Config
    groups: ProcessGroups
    device: torch.device
    rank: int
    tokenizer: object
    chunks: list[GPT]            # this pipeline stage's model chunks (one, or V virtual stages)
    link: StageLink | None       # p2p to the neighbouring stages (None without PP)
    dp: PlainDP | ZeroDP         # gradient reduction, clipping and the optimizer step
    train_data: BatchIterator
    valid_data: object
    iteration: int = 0
    consumed_samples: int = 0
    resharded_from: list[str] | None = None  # the layout changes a resharded --load went through
    stopped_by_signal: bool = False  # --exit-signal-handler: SIGTERM ended train() early


def init_distributed(cfg: Config) -> tuple[ProcessGroups, torch.device]:
    """Start torch.distributed (torchrun env, or a single process) and build all groups."""
    want = cfg.train.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.accelerator.set_device_index(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # a rank waiting on a dead or hung peer fails after this instead of hanging the job
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timeout)
    z = cfg.zero
    topo = zero_topology(cfg, world)
    tiers = qgz_tiers(cfg, topo) if (z.zero_quantized_gradients or z.zero_hierarchy) else None
    return build_groups(topo, rank, dp_tiers=tiers, hpz=z.zero_hpz_partition_size, timeout=timeout), device


def build_model(cfg: Config, groups: ProcessGroups, vocab_size: int, device: torch.device) -> list[GPT]:
    """This rank's model chunks, each initialized from the single-rank weights."""
    p, pp, stage = cfg.parallel, groups.pp.size, groups.pp_rank
    if p.num_layers_per_virtual_pipeline_stage:
        layer_sets = virtual_stage_layers(cfg.model.num_layers, pp, p.num_layers_per_virtual_pipeline_stage, stage)
    else:
        layer_sets = [stage_layers(cfg.model.num_layers, pp, stage, p.decoder_first_pipeline_num_layers,
                                   p.decoder_last_pipeline_num_layers)]
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    chunks = []
    for v, layers in enumerate(layer_sets):
        chunk = GPT(cfg.model, vocab_size, tp=groups.tp, sequence_parallel=p.sequence_parallel, layer_ids=layers,
                    pre_process=groups.is_first_stage and v == 0,
                    post_process=groups.is_last_stage and v == len(layer_sets) - 1,
                    cp=groups.cp, cp_algo=p.cp_algo, all_scan_blocks=p.all_scan_blocks)
        init_weights(chunk, cfg.train.seed, groups.tp_rank, groups.tp.size)
        chunks.append(chunk.to(device=device, dtype=dtype))
    return chunks


def activation_shape(cfg: Config, groups: ProcessGroups) -> tuple[int, int, int]:
    """Shape of the hidden states passed between pipeline stages."""
    seq = cfg.model.seq_length // groups.cp.size
    if cfg.parallel.sequence_parallel:
        seq //= groups.tp.size
    return (cfg.train.micro_batch_size, seq, cfg.model.hidden_size)


def build_data(cfg: Config, groups: ProcessGroups, tokenizer, device: torch.device, consumed: int):
    t = cfg.train
    eval_rounds = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_interval else 0
    num_samples = (t.train_iters * t.global_batch_size, eval_rounds * t.global_batch_size,
                   t.eval_iters * t.global_batch_size)
    seq = cfg.model.seq_length
    if cfg.data.mock_data:
        from .data.mock import MockGPTDataset
        train = MockGPTDataset(num_samples[0], seq, tokenizer.vocab_size, t.seed)
        valid = MockGPTDataset(max(num_samples[1], 1), seq, tokenizer.vocab_size, t.seed + 1)
    else:
        from .data.gpt_dataset import build_gpt_datasets
        train, valid, _ = build_gpt_datasets(cfg.data.data_path, cfg.data.split, seq, t.seed, num_samples,
                                             cfg.data.data_cache_path, is_builder=groups.rank == 0,
                                             barrier=lambda: comm.barrier())
    mbs = t.micro_batch_size
    valid_it = (lambda: BatchIterator(valid, 0, mbs, groups, device)) if valid is not None and eval_rounds else None
    return BatchIterator(train, consumed, mbs, groups, device), valid_it


def setup(cfg: Config) -> Run:
    groups, device = init_distributed(cfg)
    rank = groups.rank
    from .data.tokenizer import build_tokenizer
    d = cfg.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, cfg.model.vocab_size,
                                cfg.model.make_vocab_size_divisible_by, groups.tp.size)
    seed_parallel_rng(cfg.train.seed, groups.tp_rank, groups.pp_rank, groups.cp_rank, device)
    chunks = build_model(cfg, groups, tokenizer.padded_vocab_size, device)
    n_params = sum(count_parameters(c, groups.tp.size) for c in chunks)  # before ZeRO-3 shards them
    dp = build_dp_engine(cfg, chunks, groups)
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    link = StageLink(groups.pp, activation_shape(cfg, groups), dtype, device) if groups.pp.size > 1 else None
    run = Run(cfg, groups, device, rank, tokenizer, chunks, link, dp, None, None)
    if cfg.train.load:  # model, optimizer, RNG, position
        restored = load_checkpoint(run, cfg.train.load, cfg.train.ckpt_step)
        log(f"loaded {restored}" if restored else
            f"no checkpoint in {cfg.train.load} (no 'latest' file): starting from scratch", rank)
    run.train_data, run.valid_data = build_data(cfg, groups, tokenizer, device, consumed=run.consumed_samples)

    p = cfg.parallel
    log(f"layout: world {p.world_size} = TP {p.tensor_model_parallel_size} x CP {p.context_parallel_size} x "
        f"DP {p.data_parallel_size} x PP {p.pipeline_model_parallel_size} (order {p.order}, "
        f"{groups.topo.num_nodes} node(s) of {groups.topo.ranks_per_node} ranks), device {device}", rank)
    kinds = [cfg.model.layer_kind(i) for i in range(cfg.model.num_layers)]
    log(f"model: {n_params / 1e6:.2f}M parameters on pipeline stage 0, layers "
        f"{''.join('S' if k == 'softmax' else 'G' for k in kinds)} (S softmax, G GLA), vocab "
        f"{tokenizer.vocab_size} padded to {tokenizer.padded_vocab_size}, "
        f"{'bf16 compute + fp32 master weights' if cfg.train.bf16 else 'fp32'}", rank)
    log(f"kernels: {norm_backend(device)}; attention: torch SDPA; GLA: torch chunked reference; "
        f"transformer-engine: {'present, not used' if _importable('transformer_engine') else 'not installed'}",
        rank)
    log(dp.describe(), rank)
    return run


def build_dp_engine(cfg: Config, chunks: list[GPT], groups: ProcessGroups) -> PlainDP | ZeroDP:
    z = cfg.zero
    if z.zero_stage == 0:
        return PlainDP(chunks, groups, cfg.optim)
    hops = None
    if z.zero_quantized_gradients:
        hops = [getattr(groups, f"dp_tier{i}") for i in range(len(qgz_tiers(cfg, groups.topo)) + 1)]
    return ZeroDP(chunks, groups, cfg.optim, z, qgz_hops=hops)


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _report_loss(run: Run, losses: list[torch.Tensor]) -> float:
    """Mean loss over the global batch, known on every rank: the last pipeline stage
    holds it; broadcast over PP, then average over DP x CP."""
    g = run.groups
    loss = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1, device=run.device)
    loss = loss.float()
    comm.broadcast(loss, g.pp.size - 1, g.pp, "loss_report")
    comm.all_reduce(loss, g.dp_cp, "loss_report")
    return loss.item() / g.dp_cp.size


def _position_offset(run: Run) -> int:
    return run.groups.cp_rank * (run.cfg.model.seq_length // run.groups.cp.size)


def train_step(run: Run) -> tuple[float, float, float]:
    """One optimizer step. Returns (mean loss over the global batch, grad norm, lr)."""
    run.dp.zero_grad()
    losses = run_schedule(run.chunks, run.train_data, run.cfg.num_micro_batches, run.link, _position_offset(run))
    lr = learning_rate(run.cfg.optim, run.iteration, run.cfg.train.train_iters)
    grad_norm = run.dp.step(lr)
    return _report_loss(run, losses), grad_norm, lr


@torch.no_grad()
def evaluate(run: Run) -> float:
    for chunk in run.chunks:
        chunk.eval()
    data = run.valid_data()
    losses = []
    for _ in range(run.cfg.train.eval_iters):
        losses += run_schedule(run.chunks, data, run.cfg.num_micro_batches, run.link, _position_offset(run),
                               forward_only=True)
    for chunk in run.chunks:
        chunk.train()
    return _report_loss(run, losses)


class ExitSignal:
    """--exit-signal-handler: SIGTERM only sets a flag; after each step the ranks agree on it
    (a 1-element MAX all-reduce over the world), so a signal that reached any rank stops
    every rank at the same step boundary, after a checkpoint."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.received = enabled, device, False
        self.previous = signal.signal(signal.SIGTERM, self._handle) if enabled else None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def anywhere(self, groups: ProcessGroups) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([float(self.received)], device=self.device)
        comm.all_reduce(flag, groups.world, "exit_signal", op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self.previous)


def train(run: Run) -> list[dict]:
    cfg, rank = run.cfg, run.rank
    t = cfg.train
    sink = MetricsSink(cfg.log, dataclasses.asdict(cfg), enabled=rank == 0, start_iteration=run.iteration)
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    flops_step = flops_per_token(cfg.model, run.tokenizer.padded_vocab_size) * tokens_per_step
    peak, peak_desc = peak_tflops(run.device, torch.bfloat16 if t.bf16 else torch.float32, cfg.log.peak_tflops)
    log(f"MFU is measured against {peak_desc}: {peak:.3f}; model FLOPs per step {flops_step / 1e9:.2f} G", rank)
    world = cfg.parallel.world_size
    history = []
    comm.LEDGER.reset()
    stop = ExitSignal(t.exit_signal_handler, run.device)
    while run.iteration < t.train_iters:
        start = time.perf_counter()
        loss, grad_norm, lr = train_step(run)
        elapsed = time.perf_counter() - start
        run.iteration += 1
        run.consumed_samples += t.global_batch_size
        comm.LEDGER.step()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {run.iteration}")
        tflops = flops_step / elapsed / world / 1e12
        metrics = {"iteration": run.iteration, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                   "tokens_per_sec": tokens_per_step / elapsed, "step_time": elapsed,
                   "tflops_per_rank": tflops, "mfu": tflops / peak if peak else None,
                   "consumed_samples": run.consumed_samples, "memory_gib": memory_gib(run.device)}
        if t.eval_interval and run.iteration % t.eval_interval == 0 and run.valid_data:
            metrics["val_loss"] = evaluate(run)
        history.append(metrics)
        sink.write(metrics, run.iteration)
        if run.iteration % cfg.log.log_interval == 0 or run.iteration == t.train_iters:
            mfu = f"{100 * metrics['mfu']:.1f}%" if metrics["mfu"] is not None else "n/a"
            val = f" | val loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
            log(f"iter {run.iteration:5d}/{t.train_iters} | loss {loss:.4f}{val} | lr {lr:.3e} | "
                f"grad norm {grad_norm:.3f} | {metrics['tokens_per_sec']:.0f} tok/s | "
                f"{tflops:.3f} TFLOP/s/rank | MFU {mfu} | mem {metrics['memory_gib']:.2f} GiB", rank)
        saved = None
        if t.save and (run.iteration == t.train_iters or (t.save_interval and run.iteration % t.save_interval == 0)):
            saved = save_checkpoint(run, t.save)
            log(f"saved checkpoint {saved}", rank)
        if stop.anywhere(run.groups):
            saved = saved or save_checkpoint(run, t.save)
            log(f"SIGTERM received: stopped after iteration {run.iteration}, saved {saved}; resume with "
                f"--load {t.save}", rank)
            run.stopped_by_signal = True
            break
    stop.close()
    sink.close()
    if cfg.log.comm_report:
        comm.write_report(cfg.log.comm_report, world, rank)
        log(f"communication report written to {cfg.log.comm_report}", rank)
    return history


def shutdown() -> None:
    """Leave together: a rank exiting while a peer still talks to it aborts the peer."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def greedy_generate(run: Run, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with the trained model (one pipeline stage, no CP; TP ranks
    decode together and agree, since they see the same gathered logits)."""
    model = run.chunks[0]
    model.eval()
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        context = torch.tensor([ids[-run.cfg.model.seq_length:]], device=run.device)
        if run.cfg.parallel.sequence_parallel:  # the sequence must split over TP: left-pad to a multiple
            context = torch.nn.functional.pad(context, (-context.shape[1] % run.groups.tp.size, 0))
        logits = gather_from_tp(model(tokens=context), run.groups.tp)
        ids.append(int(logits[0, -1, :run.tokenizer.vocab_size].argmax()))
    return ids[len(prompt_ids):]
