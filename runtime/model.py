"""The model a plan runs: the profiler's layers at the plan's sizes, each initialised from its own seed.

Piece i of the model (0: embedding, 1..L: decoder layers, L+1: final norm and LM head) is built whole from
`seed + i`, so every rank builds only the pieces of its stage and slices its tensor-parallel shard out of them, and a
single-process reference (`reference_model`) builds the very same weights.

A model that ties its embedding and output (`tied_embeddings`) trains one matrix, as Megatron does: where the LM head
sits on the rank of the embedding (one stage) it uses the embedding's parameter (`tie_output`); on a last stage apart
from the first it holds a copy of it, whose elements have the token embedding's positions in the whole model's flat
vector, so the gradient sync sums the two copies' gradients (runtime.sync) and a checkpoint writes the matrix once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profiler.layers import DecoderLayer
from runtime.context_parallel import ContextParallel, RingAttentionLayer
from runtime.tensor_parallel import TensorParallel, VocabParallelEmbedding, VocabParallelHead
from specs.errors import SpecError
from specs.model import ModelSpec, Recompute

EMBEDDING_INIT_STD = 0.02  # Megatron's init_method_std and Hugging Face's initializer_range


def full_embedding(model: ModelSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token embedding and, GPT-style, the learned positions, drawn from N(0, 0.02^2) as Megatron and Hugging Face
    draw them: a tied LM head computes with the tokens' matrix, whose logits at torch's N(0, 1) spread by sqrt(hidden)
    (a tied model's first loss read 86.6 over a vocabulary of 1024, ln 1024 = 6.9)."""
    torch.manual_seed(seed)
    h = model.hidden_size
    tokens = nn.init.normal_(torch.empty(model.vocab_size, h), std=EMBEDDING_INIT_STD)
    if model.mlp != "gelu":
        return tokens, None
    return tokens, nn.init.normal_(torch.empty(model.seq_length, h), std=EMBEDDING_INIT_STD)


def full_layer(model: ModelSpec, index: int, seed: int, recompute: Recompute = "none") -> DecoderLayer:
    torch.manual_seed(seed + 1 + index)
    return DecoderLayer(model, 1, recompute)


def full_head(model: ModelSpec, seed: int) -> tuple[nn.Module, torch.Tensor]:
    """The final norm and the output matrix: tied, the token embedding's (a copy, for a last stage of its own)."""
    torch.manual_seed(seed + 1 + model.num_layers)
    h = model.hidden_size
    norm = nn.RMSNorm(h, eps=1e-5) if model.mlp == "swiglu" else nn.LayerNorm(h, eps=1e-5)
    if model.tied_embeddings:
        return norm, full_embedding(model, seed)[0]
    return norm, nn.Linear(h, model.vocab_size, bias=False).weight.detach()


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """The vocabulary rows of the embedding and LM head a TP rank holds: the first ranks ceil(vocabulary / tp), the
    last the rest (a vocabulary TP does not divide is split unevenly rather than padded: the model stays the one
    planned, whose rows the profiler times at the same ceiling)."""
    return -(-model.vocab_size // tp)


def check_tp(model: ModelSpec, tp: int, source: str) -> None:
    for what, value in (
        ("attention heads", model.num_attention_heads),
        ("kv heads", model.num_kv_heads),
        ("ffn hidden size", model.ffn_hidden_size),
    ):
        if value % tp:
            raise SpecError(source, "tp", f"the runtime shards {what} ({value}) over TP {tp}: it must divide")
    if (tp - 1) * vocab_rows(model, tp) >= model.vocab_size:
        raise SpecError(
            source,
            "tp",
            f"TP {tp} leaves its last rank none of the vocabulary's {model.vocab_size} rows: expected a smaller TP",
        )


def shard_layer(
    full: DecoderLayer, model: ModelSpec, tp: TensorParallel, recompute: Recompute, cp: ContextParallel | None = None
) -> DecoderLayer:
    """TP rank `tp.rank`'s shard of a whole layer: column-parallel QKV and up, row-parallel out and down; with
    context parallelism, attention around the CP ring."""
    if cp is not None and cp.size > 1:
        shard: DecoderLayer = RingAttentionLayer(model, tp.size, recompute, cp)
    else:
        shard = DecoderLayer(model, tp.size, recompute)
    k, t, d = tp.rank, tp.size, model.head_size
    heads, kv = model.num_attention_heads, model.num_kv_heads
    f = model.ffn_hidden_size

    def rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return weight[start : start + count]

    with torch.no_grad():
        shard.attention_norm.load_state_dict(full.attention_norm.state_dict())
        shard.mlp_norm.load_state_dict(full.mlp_norm.state_dict())
        q_rows, kv_rows = heads * d // t, kv * d // t
        for name in ("weight", "bias"):
            full_qkv = getattr(full.qkv, name)
            if full_qkv is None:
                continue
            q = rows(full_qkv, k * q_rows, q_rows)
            key = rows(full_qkv, heads * d + k * kv_rows, kv_rows)
            value = rows(full_qkv, heads * d + kv * d + k * kv_rows, kv_rows)
            getattr(shard.qkv, name).copy_(torch.cat([q, key, value]))
        shard.out.weight.copy_(full.out.weight[:, k * q_rows : (k + 1) * q_rows])
        per = f // t
        if model.mlp == "swiglu":
            gate, value = full.up.weight.chunk(2)
            shard.up.weight.copy_(torch.cat([rows(gate, k * per, per), rows(value, k * per, per)]))
        else:
            shard.up.weight.copy_(rows(full.up.weight, k * per, per))
            shard.up.bias.copy_(rows(full.up.bias, k * per, per))
        shard.down.weight.copy_(full.down.weight[:, k * per : (k + 1) * per])
        for row_parallel, whole in ((shard.out, full.out), (shard.down, full.down)):
            if row_parallel.bias is not None:  # added once, after the reduction: rank 0 keeps it
                row_parallel.bias.copy_(whole.bias if k == 0 else torch.zeros_like(whole.bias))
                row_parallel.bias.requires_grad_(k == 0)
    shard.enter_tp, shard.leave_tp = tp.enter, tp.leave
    return shard


class StageModule(nn.Module):
    """Layers [start, end) of the model for one TP rank, with the embedding on the first stage and the LM head and
    loss on the last. forward(x) gives the stage output; the last stage's is the micro-batch's mean loss (over this
    CP rank's tokens, with context parallelism). Built from whole pieces (`seeded_pieces`, or a reference model's
    gradients for comparing shards)."""

    def __init__(
        self,
        model: ModelSpec,
        pieces: Pieces,
        tp: TensorParallel,
        recompute: Recompute,
        cp: ContextParallel | None = None,
    ) -> None:
        super().__init__()
        rows = vocab_rows(model, tp.size)
        lo = tp.rank * rows  # the last rank's slices end at the vocabulary's end
        self.embedding = None
        if pieces.embedding is not None:
            tokens, positions = pieces.embedding
            token_positions = cp.positions if cp is not None and cp.size > 1 else None
            self.embedding = VocabParallelEmbedding(tokens[lo : lo + rows], lo, tp, positions, token_positions)
        self.layers = nn.ModuleList(shard_layer(layer, model, tp, recompute, cp) for layer in pieces.layers)
        self.head = None
        if pieces.head is not None:
            norm, output = pieces.head
            self.head = VocabParallelHead(copy.deepcopy(norm), output[lo : lo + rows], lo, tp)
        tie_output(model, [self])

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None:
            return self.head(x, targets)
        return x


def tie_output(model: ModelSpec, modules: list[StageModule]) -> None:
    """A tied model's LM head on the rank of its embedding (a one-stage pipeline, its first and last model chunks)
    computes with the embedding's parameter: one matrix, whose gradient sums both uses."""
    embedding, head = modules[0].embedding, modules[-1].head
    if model.tied_embeddings and embedding is not None and head is not None:
        head.weight = embedding.weight


def trainable_parameters(modules: list[StageModule]) -> list[nn.Parameter]:
    """A rank's trainable parameters over its model chunks in order, each once (a tied matrix serves two chunks)."""
    seen: set[int] = set()
    params = []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


@dataclass
class Pieces:
    """Whole (unsharded) pieces of one stage."""

    embedding: tuple[torch.Tensor, torch.Tensor | None] | None
    layers: list[DecoderLayer]
    head: tuple[nn.Module, torch.Tensor] | None


def seeded_pieces(model: ModelSpec, start: int, end: int, first: bool, last: bool, seed: int) -> Pieces:
    return Pieces(
        full_embedding(model, seed) if first else None,
        [full_layer(model, i, seed) for i in range(start, end)],
        full_head(model, seed) if last else None,
    )


def piece_offsets(model: ModelSpec) -> list[int]:
    """Where each piece (0: embedding, 1..L: layers, L + 1: final norm and head; tied, the norm alone) starts in the
    whole model's flat parameter vector, and its end: L + 3 numbers."""
    h, vocab = model.hidden_size, model.vocab_size
    embedding = vocab * h + (model.seq_length * h if model.mlp == "gelu" else 0)
    layer = sum(p.numel() for p in DecoderLayer(model, 1).parameters())
    norm = h if model.mlp == "swiglu" else 2 * h
    sizes = [embedding] + [layer] * model.num_layers + [norm + (0 if model.tied_embeddings else vocab * h)]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def numbered_shard(
    model: ModelSpec, start: int, end: int, first: bool, last: bool, tp: TensorParallel, recompute: Recompute
) -> StageModule:
    """A stage shard (in float64) whose parameters' values are their elements' positions in the whole model's flat
    parameter vector: it is cut from pieces numbered so. A tied output matrix is numbered as the token embedding."""
    offsets = piece_offsets(model)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # positions stay exact integers while the shard is cut
    try:
        pieces = seeded_pieces(model, start, end, first, last, 0)
        numbered: list[torch.Tensor] = []
        if pieces.embedding is not None:
            numbered += [t for t in pieces.embedding if t is not None]
        for layer in pieces.layers:
            numbered += [p.data for p in layer.parameters()]
        if pieces.head is not None:
            numbered += [p.data for p in pieces.head[0].parameters()]
            if not model.tied_embeddings:
                numbered.append(pieces.head[1])
        position = offsets[0 if first else start + 1]
        for tensor in numbered:
            tensor.copy_(torch.arange(position, position + tensor.numel(), dtype=torch.float64).view_as(tensor))
            position += tensor.numel()
        if position != offsets[end + 2 if last else end + 1]:
            raise RuntimeError(f"the pieces of layers {start}-{end} do not add up to the model's parameter count")
        if pieces.head is not None and model.tied_embeddings:
            output = pieces.head[1]
            output.copy_(torch.arange(output.numel(), dtype=torch.float64).view_as(output))  # the tokens' positions
        return StageModule(model, pieces, tp, recompute)
    finally:
        torch.set_default_dtype(default)


def positions_of(model: ModelSpec, shards: list[StageModule]) -> torch.Tensor:
    """The positions (numbered_shard's values) of a rank's trainable parameters over its chunks, in flat order."""
    tie_output(model, shards)
    trainable = [p.detach().reshape(-1) for p in trainable_parameters(shards)]
    return torch.cat(trainable).long() if trainable else torch.zeros(0, dtype=torch.long)


def shard_positions(
    model: ModelSpec, start: int, end: int, first: bool, last: bool, tp: TensorParallel, recompute: Recompute
) -> torch.Tensor:
    """For every element of a stage shard's trainable parameters (in `parameters()` order), its position in the whole
    model's flat parameter vector."""
    return positions_of(model, [numbered_shard(model, start, end, first, last, tp, recompute)])


def gradient_pieces(reference: ReferenceModel, start: int, end: int, first: bool, last: bool) -> Pieces:
    """The reference model's gradients laid out as pieces, so sharding them gives each rank's expected gradients."""

    def as_grads(module: nn.Module) -> nn.Module:
        clone = copy.deepcopy(module)
        for mine, theirs in zip(clone.parameters(), module.parameters(), strict=True):
            mine.data = theirs.grad.detach().clone()
        return clone

    def grad(parameter: nn.Parameter | None) -> torch.Tensor | None:
        return None if parameter is None else parameter.grad.detach().clone()

    return Pieces(
        (grad(reference.tokens), grad(reference.positions)) if first else None,  # type: ignore[arg-type]
        [as_grads(reference.layers[i]) for i in range(start, end)],  # type: ignore[misc]
        (as_grads(reference.norm), grad(reference.output)) if last else None,  # type: ignore[arg-type]
    )


class ReferenceModel(nn.Module):
    """The whole model in one process, from plain torch pieces (no TP code): what parity is checked against."""

    def __init__(self, model: ModelSpec, seed: int) -> None:
        super().__init__()
        tokens, positions = full_embedding(model, seed)
        self.tokens = nn.Parameter(tokens.clone())
        self.positions = nn.Parameter(positions.clone()) if positions is not None else None
        self.layers = nn.ModuleList(full_layer(model, i, seed) for i in range(model.num_layers))
        self.norm, output = full_head(model, seed)
        self.output = self.tokens if model.tied_embeddings else nn.Parameter(output.clone())

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.embedding(token_ids, self.tokens)
        if self.positions is not None:
            x = x + self.positions[: token_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.norm(x), self.output)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
