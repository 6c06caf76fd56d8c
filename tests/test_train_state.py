"""TrainState (training/state.py) and its place in meta.json (checkpoint/files.py): the fields a
checkpoint has always held, written and read back as before, without any process."""

import json

from megatron_zpp.checkpoint.files import meta_train_fields, train_state_of
from megatron_zpp.optim.loss_scaler import LossScaler
from megatron_zpp.training import TrainState


def _fp16_state() -> TrainState:
    state = TrainState(loss_scaler=LossScaler(65536.0, True, 1.0, 1000, 2, 0, 2))
    state.iteration, state.consumed_samples, state.consumed_valid_samples = 7, 28, 12
    state.skipped_iterations, state.skipped_samples = 1, 4
    state.loss_scaler.update(True)
    state.loss_scaler.update(True)  # hysteresis spent: the scale halves
    state.tracking["wandb_run_id"] = "abc123"
    state.consecutive_skips, state.stopped_by = 2, "signal"  # this process only: never saved
    return state


def test_meta_holds_the_fields_checkpoints_always_held():
    fields = meta_train_fields(_fp16_state().state_dict())
    assert json.loads(json.dumps(fields)) == {  # what meta.json held before the TrainState existed
        "iteration": 7,
        "consumed_samples": 28,
        "tracking": {"wandb_run_id": "abc123"},
        "train_state": {
            "consumed_valid_samples": 12,
            "loss_scaler": {"scale": 32768.0, "growth_tracker": 0, "hysteresis_left": 0},
            "skipped_iterations": 1,
            "skipped_samples": 4,
        },
    }
    plain = TrainState(iteration=3, consumed_samples=12)  # no --fp16, no validation read: no "train_state"
    assert meta_train_fields(plain.state_dict()) == {"iteration": 3, "consumed_samples": 12, "tracking": {}}


def test_a_restored_state_continues_the_saved_one():
    saved = _fp16_state()
    meta = {**meta_train_fields(saved.state_dict()), "format": "f", "config": {}}
    resumed = TrainState(loss_scaler=LossScaler(65536.0, True, 1.0, 1000, 2, 0, 2))
    resumed.load_state_dict(train_state_of(meta))
    assert resumed.state_dict() == saved.state_dict()
    assert (resumed.consecutive_skips, resumed.stopped_by, resumed.stopped_by_signal) == (0, None, False)
    fresh_scale = TrainState(loss_scaler=LossScaler(65536.0))  # --no-load-optim: the scaler starts afresh
    fresh_scale.load_state_dict(train_state_of(meta, with_loss_scaler=False))
    assert fresh_scale.loss_scaler.scale == 65536.0 and fresh_scale.skipped_iterations == 1


def test_a_checkpoint_without_train_state_restores_the_counters_only():
    state = TrainState()
    state.load_state_dict(train_state_of({"iteration": 5, "consumed_samples": 20}))
    assert (state.iteration, state.consumed_samples, state.skipped_iterations, state.tracking) == (5, 20, 0, {})
    assert state.consumed_valid_samples is None  # not known: derived from the iteration (training/evaluation.py)
