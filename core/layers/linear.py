"""Linear layers that own their weight loading (fusion, tensor-parallel slicing) and delegate the
storage and the matmul to a QuantMethod.

`weight_loader(param, tensor, shard_id)` receives a checkpoint tensor with the full (unsharded)
shape of one logical projection; the layer copies the rows or columns of this rank into the right
place of its (possibly fused) parameter. A QuantMethod never sees fusion or tensor parallelism: it
only tags each parameter with the axes the layer needs (`output_dim`, `input_dim`; `packed_dim` and
`pack_factor` when several values share one stored element). Untagged parameters are dense:
output features on axis 0, input features on axis 1.

Each layer gets its QuantMethod from the model's QuantConfig by its dotted name (`prefix`), so named
layers can stay dense; a `quant_method` given directly (a standalone layer, tests) is used as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvforge.core.distributed import heads_of_rank, tp_group, tp_rank, tp_size
from kvforge.core.plugins import QuantMethod
from kvforge.core.quant_config import QuantConfig, dense_method


class LinearBase(nn.Module):
    """y = x @ W.T + b, with W of shape [sum(out_features_per_shard), in_features] on this rank."""

    def __init__(self, in_features: int, out_features_per_shard: list[int], bias: bool,
                 quant_method: QuantMethod | None, params_dtype: torch.dtype,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features_per_shard = out_features_per_shard
        self.out_features = sum(out_features_per_shard)
        self.prefix = prefix  # the layer's dotted name in the model
        if quant_method is None:
            quant_method = quant_config.method_for(prefix) if quant_config is not None else dense_method()
        self.quant_method = quant_method
        self.quant_method.create_weights(self, in_features, out_features_per_shard, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        raise NotImplementedError

    def process_after_loading(self) -> None:
        self.quant_method.process_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def output_dim_of(param: nn.Parameter) -> int | None:
    return getattr(param, "output_dim", 0)


def input_dim_of(param: nn.Parameter) -> int | None:
    return getattr(param, "input_dim", 1 if param.dim() == 2 else None)


def stored_size(param: nn.Parameter, dim: int, features: int) -> int:
    """How many stored elements `features` logical features take along `dim` (packing divides)."""
    factor = getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1
    if features % factor:
        raise ValueError(f"{features} features do not fill whole packed words of {factor}: "
                         "this split cannot be aligned with the checkpoint's packing")
    return features // factor


def _copy_shared(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A per-input tensor (e.g. GPTQ's g_idx) that every fused shard carries: they must agree."""
    if getattr(param, "loaded_once", False) and not torch.equal(param.data, loaded.to(param.dtype)):
        raise ValueError("the fused projections' checkpoint tensors disagree on a shared per-input tensor "
                         f"of shape {tuple(loaded.shape)} (e.g. g_idx); they cannot share one layer")
    _copy(param, loaded)
    param.loaded_once = True


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(in_features, [out_features], bias, quant_method, params_dtype, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _copy(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; shards (e.g. gate and up) each split on their own."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant_method: QuantMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        self.tp_size, self.tp_rank, self.tp_group = tp_size(), tp_rank(), tp_group()
        for size in output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} is not divisible by tensor-parallel size {self.tp_size}")
        self.output_sizes = output_sizes
        super().__init__(in_features, [s // self.tp_size for s in output_sizes], bias, quant_method, params_dtype,
                         quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = output_dim_of(param)
        if dim is None:
            _copy_shared(param, loaded)
            return
        if shard_id is None and len(self.output_sizes) > 1:  # a checkpoint that fused them already (Phi-3)
            self._load_fused(param, loaded, dim)
            return
        index = 0 if shard_id is None else self._shard_index(shard_id)
        sizes = self.out_features_per_shard
        offset, size, source = (stored_size(param, dim, features) for features in (
            sum(sizes[:index]), sizes[index], self._source_start(index)))
        _copy(param.data.narrow(dim, offset, size), loaded.narrow(dim, source, size))

    def _load_fused(self, param, loaded: torch.Tensor, dim: int) -> None:
        """Each shard's part of a fused checkpoint tensor (full sizes, in stored units along `dim`), loaded as if
        the checkpoint held it apart: tensor parallelism and packing as for separate projections."""
        start = 0
        for shard_id, features in zip(self.shard_ids, self.output_sizes):
            size = stored_size(param, dim, features)
            self.weight_loader(param, loaded.narrow(dim, start, size), shard_id)
            start += size
        if start != loaded.shape[dim]:
            raise ValueError(f"{self.prefix}: a fused checkpoint tensor of {loaded.shape[dim]} rows along axis {dim} "
                             f"does not hold the {start} of its projections")

    @property
    def shard_ids(self) -> tuple[str | int, ...]:
        return tuple(range(len(self.output_sizes)))

    def _source_start(self, index: int) -> int:
        """Where this rank's output features of shard `index` start in the checkpoint tensor."""
        return self.tp_rank * self.out_features_per_shard[index]

    def _shard_index(self, shard_id: str | int) -> int:
        return int(shard_id)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused into one matmul (gate_proj + up_proj)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; query heads and kv heads are split across ranks separately."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        self.tp_size, self.tp_rank, self.tp_group = tp_size(), tp_rank(), tp_group()
        heads = heads_of_rank(num_heads, num_kv_heads, self.tp_size, self.tp_rank)
        self.heads, self.head_dim = heads, head_dim
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        LinearBase.__init__(self, hidden_size, [heads.q_count * head_dim, heads.kv_count * head_dim,
                                                heads.kv_count * head_dim], bias, quant_method, params_dtype,
                            quant_config, prefix)

    def _source_start(self, index: int) -> int:
        # this rank's heads (a KV head may be replicated on several ranks)
        return (self.heads.q_first if index == 0 else self.heads.kv_first) * self.head_dim

    shard_ids = ("q", "k", "v")

    def _shard_index(self, shard_id: str | int) -> int:
        return self.shard_ids.index(shard_id)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed with an all-reduce. `input_shard`
    (first, count) gives this rank's input features when they are not an even split (the attention
    output of whole heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 input_shard: tuple[int, int] | None = None, quant_config: QuantConfig | None = None,
                 prefix: str = "", reduce_results: bool = True) -> None:
        self.tp_size, self.tp_rank, self.tp_group = tp_size(), tp_rank(), tp_group()
        # False: the caller sums several layers' partial products and all-reduces once (a MoE block's experts)
        self.reduce_results = reduce_results
        if bias and not reduce_results:
            raise ValueError(f"{prefix}: a bias needs the reduced output (it is added once, after the sum)")
        if input_shard is None:
            if in_features % self.tp_size:
                raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {self.tp_size}")
            input_shard = (self.tp_rank * in_features // self.tp_size, in_features // self.tp_size)
        self.full_in_features, self.input_first = in_features, input_shard[0]
        self.input_split = self.tp_size > 1  # a quant method may need to know (e.g. GPTQ's group indices)
        super().__init__(input_shard[1], [out_features], bias, quant_method, params_dtype, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = input_dim_of(param)
        if dim is not None:  # keep this rank's input features; the bias is not split
            size = param.shape[dim]  # in the parameter's own units along dim: features, packed words or groups
            if size != loaded.shape[dim]:
                start, inside = divmod(self.input_first * size, self.in_features)
                if inside:
                    raise ValueError(f"this rank's input features start at {self.input_first}, inside one of the "
                                     f"checkpoint's words or groups of {self.in_features // size} features: "
                                     "this tensor-parallel split cannot be aligned with it")
                loaded = loaded.narrow(dim, start, size)
        _copy(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial products are summed.
        out = self.quant_method.apply(self, x, self.bias if self.tp_size == 1 else None)
        if self.tp_size > 1 and self.reduce_results:
            dist.all_reduce(out, group=self.tp_group)
            if self.bias is not None:
                out = out + self.bias
        return out
