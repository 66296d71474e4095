"""Executable layer ranges over block buffers.

A LayerRange holds blocks [block_start, block_end) of a block checkpoint as transformers
modules whose parameters are views over the block buffers (no copy, no deserialization):
the modules are built on the meta device and their parameters are then pointed at the
buffers. Only the layers of the range (plus the embedding / final norm + head when the
range includes the first / last block) are kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from libs.checkpoint import CheckpointIndex, block_tensors
from libs.checkpoint.format import torch_dtype

from .kv import BatchView, SlotKVCache, kv_bytes_per_slot

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

_MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


def hf_config(index: CheckpointIndex, attn_implementation: str = "sdpa"):
    """The transformers config object of a block checkpoint."""
    model_type = index.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    config = CONFIG_MAPPING[model_type].from_dict(dict(index.config))
    config._attn_implementation = attn_implementation
    return config


def kv_slot_bytes_of(index: CheckpointIndex, max_seq_len: int, block_start: int = 0,
                     block_end: int | None = None) -> int:
    """What one KV slot of `max_seq_len` tokens costs over blocks [block_start, block_end) of a
    checkpoint, known before any block is loaded (Engine.kv_slot_bytes once built): what a
    worker charges its memory budget before it builds an engine."""
    block_end = index.n_blocks if block_end is None else block_end
    layers = index.blocks[block_end - 1].layer_end - index.blocks[block_start].layer_start
    in_range = [t for b in range(block_start, block_end) for t in index.tensors_in_block(b)]
    dtype = torch_dtype(next((t.dtype for t in in_range if ".layers." in t.name), in_range[0].dtype))
    return kv_bytes_per_slot(hf_config(index), layers, max_seq_len, dtype)


def warm_up(model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES, attn_implementation: str = "sdpa") -> None:
    """Build a tiny skeleton of each model type on the meta device.

    The first skeleton a process builds pays for transformers' lazy imports and first-use
    set-up (about 1 s on a laptop core); a worker does this at start, so its first instance
    is not ready that much later than the next."""
    tiny = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    for model_type in model_types:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**tiny),
                                             attn_implementation=attn_implementation)


class BlockSource(Protocol):
    """Blocks that are still arriving (a loader's LoadJob): `wait` blocks until one is verified.

    A source may also offer `ready(block_id) -> bool` (has it arrived?): an engine over it can
    then tell whether a forward pass would wait (LayerRange.runnable)."""

    def wait(self, block_id: int, timeout: float | None = None) -> torch.Tensor: ...


class LayerRange(nn.Module):
    """Blocks [block_start, block_end) as one pipeline stage.

    forward(inputs, cache): inputs are token ids [batch, seq] if the range starts at block 0,
    else hidden states [batch, seq, hidden]; the result is hidden states, or logits
    [batch, seq, vocab] if the range ends with the last block. The KV cache is per stage;
    it is indexed by global layer index, so each stage can keep its own.

    `blocks` is either a mapping of block buffers or a BlockSource whose blocks are still
    arriving: the modules are built at once, and each block's tensors are bound the first
    time a forward pass needs them, so a first prefill runs the early layers while the
    later blocks load.
    """

    def __init__(
        self,
        index: CheckpointIndex,
        blocks: Mapping[int, torch.Tensor] | BlockSource,
        block_start: int = 0,
        block_end: int | None = None,
        device: str | torch.device | None = None,
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        block_end = index.n_blocks if block_end is None else block_end
        if not 0 <= block_start < block_end <= index.n_blocks:
            raise ValueError(f"invalid block range [{block_start}, {block_end}) for {index.n_blocks} blocks")
        if isinstance(blocks, Mapping):
            missing = [b for b in range(block_start, block_end) if b not in blocks]
            if missing:
                raise ValueError(
                    f"blocks {missing} are needed for range [{block_start}, {block_end}) but were not given")

        self.index = index
        self.block_start, self.block_end = block_start, block_end
        self.layer_start = index.blocks[block_start].layer_start
        self.layer_end = index.blocks[block_end - 1].layer_end
        self.has_embedding = index.blocks[block_start].has_embedding
        self.has_head = index.blocks[block_end - 1].has_head

        if device is None:
            if not isinstance(blocks, Mapping):
                raise ValueError("device is required when the blocks are still arriving")
            device = blocks[block_start].device
        self.device = torch.device(device)
        self.block_buffers: dict[int, torch.Tensor] = {}

        config = hf_config(index, attn_implementation)
        # Skeleton on the meta device: shapes and module code only, no memory.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        self.config = skeleton.config

        inner = skeleton.model
        self.embed_tokens = inner.embed_tokens if self.has_embedding else None
        self.layers = nn.ModuleList(inner.layers[i] for i in range(self.layer_start, self.layer_end))
        self.norm = inner.norm if self.has_head else None
        self.lm_head = skeleton.lm_head if self.has_head else None
        # Non-persistent buffers (rotary inv_freq) are not in the checkpoint: compute them on the
        # CPU and move them, as from_pretrained does, so the frequencies match it bit for bit.
        self.rotary_emb = type(inner.rotary_emb)(config=self.config).to(self.device)
        # The skeleton keeps the modules of other stages (meta: no memory) until every block of
        # this range is bound; a tuple, so that nn.Module does not register it as a submodule.
        self._skeleton = (skeleton,)
        del inner
        in_range = [t for b in range(block_start, block_end) for t in index.tensors_in_block(b)]
        self.dtype = torch_dtype(next((t.dtype for t in in_range if ".layers." in t.name), in_range[0].dtype))
        # Which block holds each layer of the range (index relative to layer_start).
        self._layer_block = [index.block_of_layer(i) for i in range(self.layer_start, self.layer_end)]
        self._unbound = set(range(block_start, block_end))
        self._source: BlockSource | None = None
        if isinstance(blocks, Mapping):
            for b in range(block_start, block_end):
                self._bind(b, blocks[b])
        else:
            self._source = blocks
        self.eval()

        layer_types, _ = get_layer_types_and_kwargs(self.config)
        self.layer_types = list(layer_types[self.layer_start : self.layer_end])
        unsupported = set(self.layer_types) - set(_MASK_FUNCTIONS)
        if unsupported:
            raise ValueError(f"unsupported attention layer types {sorted(unsupported)}")
        # The mask for each attention type is sized from the cache of the first layer of
        # that type *in this range*: earlier layers belong to other stages and stay empty.
        self._mask_layer = {}
        for i, lt in enumerate(self.layer_types):
            self._mask_layer.setdefault(lt, self.layer_start + i)

    def _bind(self, block_id: int, buffer: torch.Tensor) -> None:
        # Buffers live on the execution device; moving one is the only copy made here.
        buffer = buffer.to(self.device)
        self.block_buffers[block_id] = buffer
        for name, view in block_tensors(self.index, block_id, buffer).items():
            _assign(self._skeleton[0], name, view)
        self._unbound.discard(block_id)
        if not self._unbound:
            for name, t in [*self.named_parameters(), *self.named_buffers()]:
                if t.device.type == "meta":
                    raise ValueError(f"{name} of layers [{self.layer_start}, {self.layer_end}) is not in the blocks")
            self._skeleton = ()
            self._source = None

    def _need(self, block_id: int) -> None:
        """Bind `block_id` if it is not yet: waits for it when it is still arriving."""
        if block_id in self._unbound:
            self._bind(block_id, self._source.wait(block_id))

    @property
    def complete(self) -> bool:
        """Every block of the range is bound (nothing left to wait for)."""
        return not self._unbound

    def runnable(self) -> bool:
        """A forward pass would not wait for a block: each one is bound or has arrived (a source
        that cannot say counts as still arriving)."""
        if not self._unbound:
            return True
        ready = getattr(self._source, "ready", None)
        return ready is not None and all(ready(b) for b in self._unbound)

    def leading_ready_blocks(self) -> int:
        """Blocks block_start, block_start + 1, ... bound or arrived, up to the first that is not: how
        far a forward pass runs from the start without waiting."""
        ready = getattr(self._source, "ready", None)
        b = self.block_start
        while b < self.block_end and (b not in self._unbound or (ready is not None and ready(b))):
            b += 1
        return b - self.block_start

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def new_slot_cache(self, slots: int, max_seq_len: int) -> SlotKVCache:
        """The engine's pre-allocated KV cache for this range's layers."""
        return SlotKVCache(self.config, self.layer_start, self.layer_end, slots, max_seq_len, self.device, self.dtype)

    def seq_len(self, cache: DynamicCache) -> int:
        """Tokens already in this stage's part of the cache."""
        return cache.get_seq_length(self.layer_start)

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        cache: DynamicCache | BatchView,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        blocks: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Run the range; `logits_to_keep=k > 0` computes the head for the last k positions only.

        `blocks=(a, b)`: only blocks [a, b) of the range (a live pair's split prefill, BlitzScale
        §5.2: the loading side runs the first blocks, the serving side the rest on the hidden
        state; the engine's slot cache only). Blocks outside them are neither run nor waited for.
        """
        first, end = (self.block_start, self.block_end) if blocks is None else blocks
        if not self.block_start <= first < end <= self.block_end:
            raise ValueError(f"blocks [{first}, {end}) are not inside [{self.block_start}, {self.block_end})")
        if (first, end) != (self.block_start, self.block_end) and not isinstance(cache, BatchView):
            raise ValueError("a part of the range runs over the engine's slot cache only")
        embed = self.has_embedding and first == self.block_start
        head = self.has_head and end == self.block_end
        loading = bool(self._unbound)
        if loading:
            self._need(first)
        if embed:
            if inputs.dtype not in (torch.int32, torch.int64):
                raise TypeError("a range that starts at block 0 takes token ids")
            hidden = self.embed_tokens(inputs.to(self.device))
        else:
            hidden = inputs.to(self.device, self.dtype)
        if isinstance(cache, BatchView):
            # The engine's slot cache: every row at its own position, masks built by the view.
            position_ids = cache.position_ids()
            masks = cache.masks(set(self._mask_layer), getattr(self.config, "sliding_window", None))
        else:
            if position_ids is None:
                past = self.seq_len(cache)
                position_ids = torch.arange(past, past + hidden.shape[1], device=self.device).unsqueeze(0)
            masks = {
                lt: _MASK_FUNCTIONS[lt](
                    config=self.config,
                    inputs_embeds=hidden,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    position_ids=position_ids,
                    layer_idx=layer_idx,
                )
                for lt, layer_idx in self._mask_layer.items()
            }
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for i, (layer, lt) in enumerate(zip(self.layers, self.layer_types)):
            if not first <= self._layer_block[i] < end:
                continue
            if loading:
                self._need(self._layer_block[i])
            # transformers 5.x decoder layers return the hidden states tensor (not a tuple).
            hidden = layer(
                hidden,
                attention_mask=masks[lt],
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        if not head:
            return hidden
        if loading:
            self._need(self.block_end - 1)
        hidden = self.norm(hidden)
        if logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:, :]
        return self.lm_head(hidden)

    def extra_repr(self) -> str:
        return (
            f"blocks=[{self.block_start}, {self.block_end}), layers=[{self.layer_start}, {self.layer_end}), "
            f"embedding={self.has_embedding}, head={self.has_head}, device={self.device}"
        )


def _assign(model: nn.Module, name: str, view: torch.Tensor) -> None:
    """Point parameter (or persistent buffer) `name` of `model` at `view`."""
    module_path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name} has no place in {type(model).__name__}") from None
    if attr in module._parameters:
        expected = module._parameters[attr].shape
        if expected != view.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(view.shape)} != model shape {tuple(expected)}")
        module._parameters[attr] = nn.Parameter(view, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = view
    else:
        raise ValueError(f"checkpoint tensor {name} has no place in {type(model).__name__}")

