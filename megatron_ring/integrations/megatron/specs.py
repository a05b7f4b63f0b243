"""Layer specs with ring attention: swap the ``core_attention`` leaf of any Megatron-core spec."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ring.integrations.megatron.attention import RingAttention


def use_ring_attention(spec: Any, dilation: Any = None) -> Any:
    """A copy of ``spec`` (layer or block spec, local or TE) with every ``core_attention`` replaced.

    ``dilation``: LongNet's dilated attention on every layer (``(w, r)`` pairs) or per layer
    (``{layer_number: pairs}``), a param of :class:`RingAttention`. Raises ValueError if ``spec``
    has no ``core_attention`` leaf or uses multi-latent attention (whose K/V head dims differ from Q's).
    """
    spec = copy.deepcopy(spec)
    leaf = RingAttention if dilation is None else ModuleSpec(module=RingAttention, params={"dilation": dilation})
    if not _swap(spec, owner=None, leaf=leaf):
        raise ValueError(f"no core_attention found in {type(spec).__name__} spec; nothing to swap")
    return spec


def _swap(node: Any, owner: Any, leaf: Any) -> bool:
    """Replace ``core_attention`` in place below ``node`` by ``leaf``; ``owner`` is the enclosing module class."""
    if isinstance(node, ModuleSpec):
        return _swap(node.submodules, node.module, leaf)
    if isinstance(node, (list, tuple)):
        return any([_swap(item, owner, leaf) for item in node])
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return False
    found = False
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if field.name == "core_attention" and value is not None:
            if isinstance(owner, type) and issubclass(owner, MultiLatentAttention):
                raise ValueError(
                    f"core_attention of {owner.__name__} (multi-latent attention) is not supported by "
                    "RingAttention; allowed: SelfAttention / CrossAttention specs"
                )
            setattr(node, field.name, leaf)
            found = True
        else:
            found = _swap(value, owner, leaf) or found
    return found


def get_gpt_layer_ring_spec(dilation: Any = None, **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec(**kwargs)`` with ``core_attention = RingAttention`` (``dilation``:
    see :func:`use_ring_attention`)."""
    if kwargs.get("multi_latent_attention"):
        raise ValueError("multi_latent_attention = True is not supported by RingAttention; allowed: False")
    return use_ring_attention(get_gpt_layer_local_spec(**kwargs), dilation)


gpt_layer_ring_spec: ModuleSpec = get_gpt_layer_ring_spec()
"""The default ring layer spec as an object, for Megatron-LM's
``--spec megatron_ring.megatron gpt_layer_ring_spec`` (``--spec`` imports an attribute and uses it
as the spec; frameworks that call a spec function can use :func:`get_gpt_layer_ring_spec`)."""
