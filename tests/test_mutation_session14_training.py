"""The ``moved_past`` note of ``checkpoint_store = "in_place"`` (commit 7cd2287): behaviours a hand-made
mutation audit (session 14) found unpinned. The note must name the checkpoint the store last moved on
from, be written before the store moves (a run killed inside a segment), be written again by a resumed
run, and only warn about the checkpoint it names."""

from __future__ import annotations

import textwrap
import types
from pathlib import Path

import pytest
import torch.nn.functional as torch_F

import embstore.training.trainer as trainer
from embstore.training.trainer import TrainConfig, train

NOT_EXACT = "not exact"


def load(tmp_path: Path, ckpt_every: int = 4, batches: int = 12) -> TrainConfig:
    """A small in_place run: checkpoints every ``ckpt_every`` steps, no eval before the end."""
    p = tmp_path / "cfg.toml"
    p.write_text(textwrap.dedent(f"""
        [data]
        kind = "synthetic"
        batch_size = 32
        train_batches = {batches}
        eval_batches = 2
        bag_max = 2
        [model]
        dense_arch = [8, 4]
        over_arch = [8, 1]
        [store]
        defaults = {{ dim = 4, tiers = [{{ kind = "dram", capacity = "1KiB", policy = "lru" }}, {{ kind = "mmap" }}] }}
        [[store.table]]
        name = "a"
        num_embeddings = 200
        [[store.table]]
        name = "b"
        num_embeddings = 100
        [schedule]
        checkpoint_every = {ckpt_every}
        checkpoint_store = "in_place"
        seed = 3
        """))
    return TrainConfig.from_toml(p)


def note(out: Path) -> str | None:
    p = out / "checkpoints" / "moved_past"
    return p.read_text().strip() if p.exists() else None


def resume_warnings(cfg: TrainConfig, out: Path, caplog, **kw) -> list[str]:
    caplog.clear()
    with caplog.at_level("WARNING", logger="embstore.training.trainer"):
        train(cfg, out, resume=True, progress=False, **kw)
    return [r.getMessage() for r in caplog.records if NOT_EXACT in r.getMessage()]


def test_a_resumed_run_that_goes_on_past_its_checkpoint_notes_it(tmp_path, caplog):
    """Kills: ``last_checkpoint`` starting at None instead of the resumed checkpoint. A run stopped right at
    its checkpoint (step 4) leaves no note; resumed, it trains on past step 4 (killed at 6, before the
    next checkpoint): the store now holds rows of step 6 under step 4's dense state, so the note must
    name step_4 and the next resume must warn."""
    cfg, out = load(tmp_path), tmp_path / "out"
    train(cfg, out, progress=False, stop_at=4)
    assert note(out) is None
    assert resume_warnings(cfg, out, caplog, stop_at=6) == []
    assert note(out) == "step_4"
    (msg,) = resume_warnings(cfg, out, caplog)
    assert "step_4" in msg


def test_a_note_naming_an_older_checkpoint_does_not_make_a_later_resume_warn(tmp_path, caplog):
    """Kills: the resume check testing only that a note exists (``_moved_past(out) is not None``) instead of
    that it names the checkpoint resumed from. The run moved on from step_4 (note step_4) and stopped right
    at its checkpoint step_8: the store is exactly step_8's, the resume is exact and must not warn."""
    cfg, out = load(tmp_path), tmp_path / "out"
    train(cfg, out, progress=False, stop_at=8)
    assert note(out) == "step_4"
    assert resume_warnings(cfg, out, caplog, stop_at=8) == []


def test_the_note_is_written_before_the_store_moves_on(tmp_path, caplog, monkeypatch):
    """Kills: the note written after the segment's steps (when the store has already moved on). The run
    dies inside the segment after checkpoint step_4 (an error in step 6's loss, after step 5 wrote its
    rows): nothing after that point runs, so the note must already be there and the resume must warn."""
    cfg, out = load(tmp_path), tmp_path / "out"
    calls = {"n": 0}

    def loss(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("killed in step 6")
        return torch_F.binary_cross_entropy_with_logits(*a, **kw)

    proxy = types.SimpleNamespace(**{k: getattr(torch_F, k) for k in dir(torch_F) if not k.startswith("__")})
    proxy.binary_cross_entropy_with_logits = loss
    monkeypatch.setattr(trainer, "F", proxy)
    with pytest.raises(RuntimeError, match="killed in step 6"):
        train(cfg, out, progress=False)
    monkeypatch.undo()
    assert note(out) == "step_4"
    (msg,) = resume_warnings(cfg, out, caplog)
    assert "step_4" in msg
