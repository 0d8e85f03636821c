"""The recurrent state of a hybrid model's slots: Qwen3.5's Gated DeltaNet (linear-attention) layers keep, per
sequence, a conv state [conv_dim, kernel] and a recurrent state [value_heads, key_dim, value_dim] instead of keys and
values. Both are fixed-size, so each slot holds one of each per linear layer, beside its KV columns (slot_cache.py).

A pass gathers its rows' states (`read`), the model updates them as transformers' own cache would (the conv state in
place on a single-token step, by `update_conv_state` on a prefill chunk; then `update_recurrent_state`), and the
rows that count are written back (`write`): a decode pass's idle rows (free slots, prompts still prefilling) keep
their state, as they keep their KV by writing the scratch column.

Prefix reuse cannot share this state by reference (a slot's state is that of its whole sequence, not of any prefix),
so for such models the slot cache looks for no cached prefix; a prompt's `num_samples` sequences still share its one
prefill: its state at the prompt's end is copied into each of their slots (`copy`), as its KV is.
"""

from __future__ import annotations

from typing import Any

import torch

RECURRENT_KINDS = frozenset({"linear_attention"})  # Gated DeltaNet layers (Qwen3.5, Qwen3-Next)
STATE_FIELDS = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                "linear_value_head_dim")


def recurrent_layers(config: Any) -> list[int]:
    """The indices of the layers that keep recurrent state instead of KV."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind in RECURRENT_KINDS]


def missing_fields(config: Any) -> list[str]:
    """The Gated DeltaNet shape fields the config lacks (a recurrent layer of another kind has none of them)."""
    return [name for name in STATE_FIELDS if getattr(config, name, None) is None]


def state_shapes(config: Any) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per slot and linear layer: the conv state (conv_dim, kernel) and the recurrent state (v_heads, k_dim, v_dim)."""
    key_dim = int(config.linear_num_key_heads) * int(config.linear_key_head_dim)
    value_heads, value_dim = int(config.linear_num_value_heads), int(config.linear_value_head_dim)
    conv = (2 * key_dim + value_heads * value_dim, int(config.linear_conv_kernel_dim))
    return conv, (value_heads, int(config.linear_key_head_dim), value_dim)


def state_bytes(config: Any, dtype: torch.dtype) -> int:
    """One slot's state bytes, every linear layer (0 for a model with none)."""
    layers = recurrent_layers(config)
    if not layers:
        return 0
    conv, recurrent = state_shapes(config)
    per_layer = (conv[0] * conv[1] * torch.empty((), dtype=dtype).element_size()
                 + recurrent[0] * recurrent[1] * recurrent[2] * 4)  # the recurrent state stays fp32, as transformers'
    return len(layers) * per_layer


class SlotStates:
    """The conv and recurrent states of every slot, one tensor of each for all linear layers."""

    def __init__(self, config: Any, count: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = recurrent_layers(config)
        self.index = {layer: j for j, layer in enumerate(self.layers)}  # model layer -> its row in the buffers
        self.conv_shape, self.recurrent_shape = state_shapes(config)
        self.conv = torch.zeros(len(self.layers), count, *self.conv_shape, dtype=dtype, device=device)
        self.recurrent = torch.zeros(len(self.layers), count, *self.recurrent_shape, dtype=torch.float32, device=device)
        self.slot_bytes = state_bytes(config, dtype)

    def zero(self, slot: int) -> None:
        """A slot taken for a new sequence starts from no state (as a fresh transformers cache does)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy(self, source: int, targets: torch.Tensor) -> None:
        """`source`'s state into each slot of `targets` ([n] int64 on the device: a prompt's samples), every layer."""
        for buffer in (self.conv, self.recurrent):
            buffer.index_copy_(1, targets, buffer[:, source:source + 1].expand(-1, int(targets.shape[0]), *buffer.shape[2:]))

    def resize(self, count: int) -> None:
        """Grow to `count` slots, keeping every slot's state."""
        grow = count - int(self.conv.shape[1])
        if grow > 0:
            self.conv = torch.cat([self.conv, self.conv.new_zeros(self.conv.shape[0], grow, *self.conv_shape)], 1)
            self.recurrent = torch.cat(
                [self.recurrent, self.recurrent.new_zeros(self.recurrent.shape[0], grow, *self.recurrent_shape)], 1)

    def read(self, layer: int, start: int | None, stop: int | None, slots: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pass's rows' conv and recurrent states (the model updates the conv state in place)."""
        j = self.index[layer]
        if slots is None:
            return self.conv[j, start:stop].clone(), self.recurrent[j, start:stop].clone()
        return self.conv[j].index_select(0, slots), self.recurrent[j].index_select(0, slots)

    def write(self, layer: int, start: int | None, stop: int | None, slots: torch.Tensor | None, keep: torch.Tensor,
              conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The rows' new states back into their slots, where `keep` [rows] (a device mask: no host sync)."""
        j = self.index[layer]
        for buffer, new in ((self.conv[j], conv), (self.recurrent[j], recurrent)):
            mask = keep.view(-1, *([1] * (new.dim() - 1)))
            if slots is None:
                old = buffer[start:stop]
                old.copy_(torch.where(mask, new.to(buffer.dtype), old))
            else:
                buffer.index_copy_(0, slots, torch.where(mask, new.to(buffer.dtype), buffer.index_select(0, slots)))
