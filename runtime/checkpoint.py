"""Checkpoints of a plan's training state with torch.distributed.checkpoint (DCP), written so any plan can load them.

Every tensor is saved under its global name and shape, whatever the plan that trains it: `model.layers.7.qkv.weight`
is the whole layer 7's QKV weight, wherever that layer ran, at whatever TP width, in whatever interleaved chunk; the
Adam moments are `optimizer.exp_avg.<same name>` and `optimizer.exp_avg_sq.<same name>`, also whole. A rank writes
the rectangles of those global tensors it holds (found from each element's position in the whole model,
runtime.model.shard_positions: a TP shard is a row block or a column block, a ZeRO-1 slice of a flat vector is a few
row runs), as DCP shards; each element is written once (family 0, replica 0 for weights and for moments without
ZeRO, the replica that updates it under ZeRO-1/2 and, for weights too, ZeRO-3, TP rank 0 for what TP replicates, the
first stage for a tied matrix whose copy a last stage holds), and DCP's global plan check refuses a save whose shards
overlap in other shapes (it keeps one of two identical shards silently: the writers are chosen here). On load a
rank asks DCP for the rectangles it holds under its own plan, and DCP reads the overlapping parts of whichever shards
were saved: resharding between plans (stages, TP widths, replicas, ZeRO, families) is DCP's chunk overlap, nothing
hetplan-specific.

Beside the tensors: the step, the samples seen (the synthetic data is a function of seed and step, so the step is
the data position), each rank's torch RNG state, and `hetplan-checkpoint.json` with the model, the plan's layout and
the run's settings. A checkpoint is written into `.tmp-step-N/` and renamed to `step-N/` only once DCP's `.metadata`
(written last, by rank 0, after every rank's data) and the JSON are on disk, so a crash mid-save leaves the previous
checkpoint the latest complete one. A `Saver` writes synchronously or in the background (DCP's async_save).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from profiler.layers import DecoderLayer
from runtime.model import piece_offsets
from runtime.sync import rank_positions
from specs.errors import SpecError
from specs.layout import Strategy
from specs.model import MODEL_SHAPE_FIELDS, NO_HEAD_DIM, ModelSpec

CHECKPOINT_SCHEMA = "hetplan.checkpoint/1"
INFO_FILE = "hetplan-checkpoint.json"
METADATA_FILE = ".metadata"  # DCP's, written last
# a checkpoint records its model's shape (MODEL_SHAPE_FIELDS): whether it ties its embedding too (a tied model's
# checkpoint has no head.output; one without the field was saved by a runtime that trained every model untied), and
# head_dim only where the model gives one


@dataclass(frozen=True)
class GlobalTensor:
    """One tensor of the whole model: its name, shape, and where it starts in the whole model's flat vector."""

    name: str
    shape: tuple[int, ...]
    start: int


def global_tensors(model: ModelSpec) -> list[GlobalTensor]:
    """The whole model's tensors in piece order (embedding, layers 0..L-1, final norm and head; tied, no head), as
    runtime.model.shard_positions numbers their elements."""
    with torch.device("meta"):
        layer = DecoderLayer(model, 1)
        norm = torch.nn.RMSNorm(model.hidden_size) if model.mlp == "swiglu" else torch.nn.LayerNorm(model.hidden_size)
    h, vocab = model.hidden_size, model.vocab_size
    named: list[tuple[str, tuple[int, ...]]] = [("embedding.tokens", (vocab, h))]
    if model.mlp == "gelu":
        named.append(("embedding.positions", (model.seq_length, h)))
    for i in range(model.num_layers):
        named += [(f"layers.{i}.{name}", tuple(p.shape)) for name, p in layer.named_parameters()]
    named += [(f"head.norm.{name}", tuple(p.shape)) for name, p in norm.named_parameters()]
    if not model.tied_embeddings:
        named.append(("head.output", (vocab, h)))
    out, start = [], 0
    for name, shape in named:
        out.append(GlobalTensor(name, shape, start))
        start += int(np.prod(shape))
    if start != piece_offsets(model)[-1]:
        raise RuntimeError("the checkpoint's tensor table does not add up to the model's parameter count")
    return out


@dataclass(frozen=True)
class Block:
    """A rectangle of a global tensor that a rank holds contiguously (row-major) in a local flat vector."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_start: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.sizes))


def blocks(table: list[GlobalTensor], positions: np.ndarray, local: np.ndarray) -> list[Block]:
    """The rectangles of global tensors covered by local elements `local` (indices into a flat vector, increasing)
    whose positions in the whole model are `positions`: runs of consecutive columns of one row, stacked into one
    rectangle while the next run starts one row lower at the same column with the same length."""
    if positions.size == 0:
        return []
    starts = np.array([t.start for t in table], dtype=np.int64)
    cols = np.array([t.shape[-1] for t in table], dtype=np.int64)
    which = np.searchsorted(starts, positions, side="right") - 1
    relative = positions - starts[which]
    row, col = relative // cols[which], relative % cols[which]
    new = np.ones(positions.size, dtype=bool)
    new[1:] = (
        (which[1:] != which[:-1]) | (row[1:] != row[:-1]) | (col[1:] != col[:-1] + 1) | (local[1:] != local[:-1] + 1)
    )
    first = np.flatnonzero(new)
    length = np.diff(np.append(first, positions.size))
    s_which, s_row, s_col, s_local = which[first], row[first], col[first], local[first]
    grow = np.zeros(first.size, dtype=bool)
    grow[1:] = (
        (s_which[1:] == s_which[:-1])
        & (s_col[1:] == s_col[:-1])
        & (length[1:] == length[:-1])
        & (s_row[1:] == s_row[:-1] + 1)
        & (s_local[1:] == s_local[:-1] + length[:-1])
    )
    out = []
    heads = np.flatnonzero(~grow)
    ends = np.append(heads[1:], first.size)
    for head, end in zip(heads.tolist(), ends.tolist(), strict=True):
        tensor = table[int(s_which[head])]
        rows, width = end - head, int(length[head])
        if len(tensor.shape) == 1:
            offsets, sizes = (int(s_col[head]),), (width,)
        else:
            offsets, sizes = (int(s_row[head]), int(s_col[head])), (rows, width)
        out.append(Block(tensor.name, offsets, sizes, int(s_local[head])))
    return out


@dataclass
class Sharded:
    """What one rank holds of the checkpoint's global tensors: name -> (global shape, [(offsets, local view)])."""

    shapes: dict[str, tuple[int, ...]]
    pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]

    @classmethod
    def empty(cls) -> Sharded:
        return cls({}, {})

    def add(self, prefix: str, table: list[GlobalTensor], found: list[Block], flat: torch.Tensor) -> None:
        """Views of `flat` for the blocks, under `prefix` + the global name."""
        shapes = {t.name: t.shape for t in table}
        for block in found:
            name = prefix + block.name
            self.shapes[name] = shapes[block.name]
            view = flat[block.local_start : block.local_start + block.numel].view(block.sizes)
            self.pieces.setdefault(name, []).append((block.offsets, view))

    def find(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset or ())
        for held, view in self.pieces[index.fqn]:
            if held == offsets:
                return view
        raise KeyError(f"{index.fqn} at {offsets}")


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner for the plain entries, plus one shard write item per block this rank writes."""

    def __init__(self, sharded: Sharded) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.sharded = sharded

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for name, pieces in self.sharded.pieces.items():
            size = torch.Size(self.sharded.shapes[name])
            for offsets, view in pieces:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.size())
                data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(view), size=size)
                items.append(WriteItem(index=MetadataIndex(name, offsets), type=WriteItemType.SHARD, tensor_data=data))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.index.fqn in self.sharded.pieces:
            return self.sharded.find(write_item.index).contiguous()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner for the plain entries; for the blocks, DCP's own resharding (saved chunks overlapping them)."""

    def __init__(self, sharded: Sharded, source: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.sharded, self.source = sharded, source

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = []
        for name, pieces in self.sharded.pieces.items():
            saved = self.metadata.state_dict_metadata.get(name)
            shape = self.sharded.shapes[name]
            if not isinstance(saved, TensorStorageMetadata) or tuple(saved.size) != shape:
                found = "missing" if saved is None else f"{tuple(getattr(saved, 'size', ()))}"
                raise SpecError(
                    self.source, name, f"the plan needs a tensor of shape {shape}, the checkpoint has {found}"
                )
            chunks = [ChunkStorageMetadata(torch.Size(offsets), view.size()) for offsets, view in pieces]
            items += create_read_items_for_chunk_list(name, saved, chunks)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.sharded.pieces:
            return self.sharded.find(index)
        return super().lookup_tensor(index)


@dataclass(frozen=True)
class Holdings:
    """Where a rank's local flat vectors sit in the whole model, and which of their elements it writes."""

    positions: np.ndarray  # per element of the rank's flat trainable-parameter vector
    moments: tuple[int, int]  # [lo, hi) of that vector whose Adam moments the rank keeps
    write_params: np.ndarray  # bool per element: this rank writes it
    write_moments: np.ndarray  # bool per element of [lo, hi)


def state_dict(
    table: list[GlobalTensor], holdings: Holdings, params: torch.Tensor, exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor, writing: bool,
) -> Sharded:  # fmt: skip
    """The blocks of the flat parameter vector and the moment slices, all held (loading) or written (saving)."""
    lo, hi = holdings.moments
    sharded = Sharded.empty()
    everything = np.arange(holdings.positions.size)
    chosen = everything[holdings.write_params] if writing else everything
    sharded.add("model.", table, blocks(table, holdings.positions[chosen], chosen), params)
    slice_index = np.arange(hi - lo)
    chosen = slice_index[holdings.write_moments] if writing else slice_index
    moment_positions = holdings.positions[lo:hi][chosen]
    found = blocks(table, moment_positions, chosen)
    sharded.add("optimizer.exp_avg.", table, found, exp_avg)
    sharded.add("optimizer.exp_avg_sq.", table, found, exp_avg_sq)
    return sharded


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _commit(root: Path, temp: Path, final: Path, info: dict[str, Any], keep: int) -> None:
    """Rank 0, once DCP's .metadata is written (after every rank's data): the description, then the rename that
    makes the checkpoint complete, then the oldest complete ones beyond `keep` go."""
    (temp / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True), encoding="utf-8")
    _fsync_dir(temp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temp, final)
    _fsync_dir(root)
    for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


class Saver:
    """Writes a run's checkpoints. Synchronous: every rank returns once the checkpoint is committed. Asynchronous
    (`background`): DCP's async_save writes from a thread over a Gloo group of its own (the training's collectives
    keep theirs), on copies taken when the save starts, and rank 0 commits the checkpoint as soon as the write is
    done (DCP's future completes after its metadata is written), while training goes on; a run that dies before
    then leaves the previous checkpoint the latest complete one. One save at a time: the next waits for the last.
    Every rank creates a Saver at the same point (the group is created collectively)."""

    def __init__(self, background: bool) -> None:
        self.group = dist.new_group(backend="gloo") if background else None
        self.pending: tuple[Any, threading.Event, list[BaseException]] | None = None
        self.written: list[dict[str, Any]] = []  # background saves: how long each took to be committed

    def save(
        self, root: str | Path, step: int, sharded: Sharded, plain: dict[str, Any], info: dict[str, Any], keep: int
    ) -> tuple[Path, float]:
        """Every rank calls this (idle ranks with nothing to write). Returns (the checkpoint, seconds the training
        waited)."""
        started = time.perf_counter()
        self.wait()
        root = Path(root)
        final, temp = step_dir(root, step), root / f".tmp-step-{step:08d}"
        rank = dist.get_rank()
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir()
        dist.barrier()
        writer, planner = dcp.FileSystemWriter(temp), _SavePlanner(sharded)
        if self.group is None:
            dcp.save({**plain}, storage_writer=writer, planner=planner)
            if rank == 0:  # dcp.save returns on every rank only after rank 0 wrote .metadata
                _commit(root, temp, final, info, keep)
            dist.barrier()
        else:
            future = dcp.async_save({**plain}, storage_writer=writer, planner=planner, process_group=self.group)
            committed, errors = threading.Event(), []

            def commit(done: Any) -> None:
                try:
                    if done.exception() is None and rank == 0:
                        _commit(root, temp, final, info, keep)
                        self.written.append({"committed": str(final), "write_s": time.perf_counter() - started})
                except BaseException as err:  # raised again by wait(), on the training's thread
                    errors.append(err)
                finally:
                    committed.set()

            future.add_done_callback(commit)
            self.pending = (future, committed, errors)
        return final, time.perf_counter() - started

    def wait(self) -> None:
        """Finish the pending background save (and rank 0's commit of it)."""
        if self.pending is None:
            return
        future, committed, errors = self.pending
        self.pending = None
        future.result()
        committed.wait()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.wait()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under a checkpoint directory, oldest first."""
    found = [p for p in root.glob("step-*") if (p / METADATA_FILE).is_file() and (p / INFO_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve(path: str | Path) -> Path:
    """The checkpoint `path` names: itself when it is one, else the latest complete one under it; a one-line
    SpecError when there is none, or when it is a checkpoint whose save did not finish."""
    path = Path(path)
    if path.exists() and not path.is_dir():  # (a file of one, say its .metadata)
        raise SpecError(str(path), "", "is a file: expected a checkpoint directory (step-NNNNNNNN) or one above them")
    if not path.is_dir():
        raise SpecError(str(path), "", "no such checkpoint directory")
    if (path / METADATA_FILE).exists() or (path / INFO_FILE).exists() or path.name.startswith(("step-", ".tmp-step-")):
        for needed in (METADATA_FILE, INFO_FILE):
            if not (path / needed).is_file():
                raise SpecError(
                    str(path / needed), "", "missing: not a complete checkpoint (a save interrupted before its "
                    "metadata was written; load its parent directory to take the latest complete one)",
                )  # fmt: skip
        return path
    found = complete_checkpoints(path)
    if not found:
        raise SpecError(
            str(path), "", f"no complete checkpoint (a step-N directory with {METADATA_FILE} and {INFO_FILE})"
        )
    return found[-1]


def read_info(checkpoint: Path) -> dict[str, Any]:
    source = checkpoint / INFO_FILE
    try:
        info = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SpecError(str(source), "", f"not readable as a hetplan checkpoint description ({err})") from None
    if not isinstance(info, dict) or info.get("schema") != CHECKPOINT_SCHEMA:
        raise SpecError(str(source), "schema", f"expected {CHECKPOINT_SCHEMA!r}")
    return info


def model_identity(model: ModelSpec) -> dict[str, Any]:
    dumped = model.model_dump(mode="json")
    return {key: dumped[key] for key in MODEL_SHAPE_FIELDS if key in dumped}


def check_model(info: dict[str, Any], model: ModelSpec, checkpoint: Path) -> None:
    """A checkpoint of another model is refused in one line naming the first field that differs."""
    saved, mine = {"tied_embeddings": False, **info.get("model_identity", {})}, model_identity(model)
    for key in MODEL_SHAPE_FIELDS:
        if saved.get(key) == mine.get(key):
            continue
        if key == "tied_embeddings":
            trained = "one matrix for both" if saved[key] else "an output matrix apart from the embedding"
            raise SpecError(
                str(checkpoint / INFO_FILE), f"model.{key}",
                f"the checkpoint trained {trained}, the plan's model {'ties' if mine[key] else 'does not tie'} its "
                "embedding and output: a checkpoint of another model",
            )  # fmt: skip
        was, now = (
            NO_HEAD_DIM if key == "head_dim" and v is None else repr(v) for v in (saved.get(key), mine.get(key))
        )
        raise SpecError(
            str(checkpoint / INFO_FILE), f"model.{key}",
            f"the checkpoint was saved for {was}, the plan trains {now}: a checkpoint of another model",
        )  # fmt: skip


def load(checkpoint: Path, sharded: Sharded, plain: dict[str, Any]) -> float:
    """Fill this rank's blocks and the plain entries from `checkpoint` (every rank calls it); returns seconds."""
    started = time.perf_counter()
    dcp.load(plain, storage_reader=dcp.FileSystemReader(checkpoint), planner=_LoadPlanner(sharded, str(checkpoint)))
    return time.perf_counter() - started


def saved_keys(checkpoint: Path) -> set[str]:
    return set(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)


def rank_holdings(
    model: ModelSpec, strategy: Strategy, family: int, index: int, replica: int, tp_rank: int,
    moments: tuple[int, int], zero: bool, sharded_weights: bool = False,
) -> Holdings:  # fmt: skip
    """Positions of a rank's flat parameter vector (runtime.sync.rank_positions) and which elements it writes: family
    0 only; replica 0 for weights (and for moments without ZeRO, under which each replica writes its own slice);
    among TP ranks holding the same element (replicated norms), the first; a tied matrix, the first stage (a later
    stage holds its copy). With `sharded_weights` (ZeRO-3) the rank's flat parameter vector is only its slice
    `moments` of the whole one, and each replica writes its own slice."""
    positions = rank_positions(model, strategy, family, index, tp_rank)
    earlier = [rank_positions(model, strategy, family, index, k) for k in range(tp_rank)]
    owned = ~torch.isin(positions, torch.cat(earlier)) if earlier else torch.ones(positions.numel(), dtype=torch.bool)
    if model.tied_embeddings and index > 0:  # a later stage's copy of the tied matrix (the token embedding, first)
        owned &= positions >= model.vocab_size * model.hidden_size
    owned_np = owned.numpy() & (family == 0)
    lo, hi = moments
    if sharded_weights:
        return Holdings(positions[lo:hi].numpy().astype(np.int64), (0, hi - lo), owned_np[lo:hi], owned_np[lo:hi])
    return Holdings(
        positions.numpy().astype(np.int64),
        moments,
        owned_np & (replica == 0),
        owned_np[lo:hi] & (zero or replica == 0),
    )


@dataclass(frozen=True)
class Resumed:
    """What a load gives a rank: the step to continue from and the seconds the load took."""

    step: int
    optimizer_steps: int
    load_s: float
    checkpoint: str


def plain_entries(rank: int, step: int, samples_seen: int, optimizer_steps: int) -> dict[str, Any]:
    return {
        "train.step": torch.tensor(step, dtype=torch.int64),
        "train.samples_seen": torch.tensor(samples_seen, dtype=torch.int64),
        "optimizer.step": torch.tensor(optimizer_steps, dtype=torch.int64),
        f"rng.rank{rank}": torch.get_rng_state(),
    }


def save_rank(
    saver: Saver, root: str | Path, step: int, samples_seen: int, info: dict[str, Any],
    table: list[GlobalTensor] | None, holdings: Holdings | None, params: list[torch.Tensor], exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor, optimizer_steps: int, keep: int = 2,
) -> tuple[Path, float]:  # fmt: skip
    """One rank's part of a checkpoint after `step` completed steps (an idle rank passes holdings None). The data
    written are copies (the flat parameters are a new tensor; the moments are cloned for a background save)."""
    rank = dist.get_rank()
    sharded = Sharded.empty()
    if holdings is not None and table is not None:
        flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        if saver.group is not None:
            exp_avg, exp_avg_sq = exp_avg.clone(), exp_avg_sq.clone()
        sharded = state_dict(table, holdings, flat, exp_avg, exp_avg_sq, writing=True)
    plain = plain_entries(rank, step, samples_seen, optimizer_steps)
    return saver.save(root, step, sharded, plain, info, keep)


def load_rank(
    checkpoint: Path, table: list[GlobalTensor] | None, holdings: Holdings | None, params: list[torch.Tensor],
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
) -> Resumed:  # fmt: skip
    """Fill a rank's parameters and moments from `checkpoint`, resharded to its holdings; restore its RNG state when
    the checkpoint has one for this rank number."""
    rank = dist.get_rank()
    plain = plain_entries(rank, 0, 0, 0)
    if f"rng.rank{rank}" not in saved_keys(checkpoint):
        del plain[f"rng.rank{rank}"]
    sharded, flat = Sharded.empty(), torch.zeros(0)
    if holdings is not None and table is not None:
        dtype = params[0].dtype if params else torch.float32
        flat = torch.zeros(int(holdings.positions.size), dtype=dtype)
        sharded = state_dict(table, holdings, flat, exp_avg, exp_avg_sq, writing=False)
    seconds = load(checkpoint, sharded, plain)
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    if f"rng.rank{rank}" in plain:
        torch.set_rng_state(plain[f"rng.rank{rank}"])
    return Resumed(int(plain["train.step"]), int(plain["optimizer.step"]), seconds, str(checkpoint))


def describe(
    step: int, samples_seen: int, model: ModelSpec, strategy: Strategy, global_batch: int, seq_length: int,
    seed: int, dtype: str, world_size: int, cluster: str,
) -> dict[str, Any]:  # fmt: skip
    """The checkpoint's hetplan-checkpoint.json: what it holds and the layout it was saved under."""
    return {
        "schema": CHECKPOINT_SCHEMA,
        "step": step,
        "samples_seen": samples_seen,
        "seed": seed,
        "dtype": dtype,
        "global_batch": global_batch,
        "seq_length": seq_length,
        "model": model.model_dump(mode="json"),
        "model_identity": model_identity(model),
        "strategy": dataclasses.asdict(strategy),
        "world_size": world_size,
        "cluster": cluster,
        "saved_unix_time_s": time.time(),
        "tensors": "model.<name> and optimizer.exp_avg[_sq].<name>: whole tensors of the model (global names and "
        "shapes), saved as DCP shards",
    }


def check_resume(path: str | Path, model: ModelSpec, steps: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a run resumes from and its description, checked before any process starts: complete, of this
    model, and not already past the steps asked for (one-line SpecErrors)."""
    found = resolve(path)
    info = read_info(found)
    check_model(info, model, found)
    if int(info["step"]) >= steps:
        raise SpecError(
            str(found / INFO_FILE), "step", f"the checkpoint is at step {info['step']}: ask for more --steps than that"
        )
    return found, info
