"""stellarax: JAX accelerator kernels with first-class autotuning.

The public surface: op functions, op classes (`<Backend><Op>`), the autotuning
entry points, and what a user's own op is made of (`Op`, `config_dataclass`).
Everything else is internal.
"""

__version__ = "0.1.0"

from stellarax._requirements import require_jax as _require_jax

_require_jax()  # before the modules that use jax's newer names

from stellarax import autotuning as autotuning
from stellarax.autotuning import AutotuningResult as AutotuningResult
from stellarax.autotuning import Autotuner as Autotuner
from stellarax.autotuning import autotune as autotune
from stellarax.core.bound_args import BoundArguments as BoundArguments
from stellarax.core.calling import BackwardFallbackWarning as BackwardFallbackWarning
from stellarax.core.config import config_dataclass as config_dataclass
from stellarax.core.op import ImplementationUnavailableError as ImplementationUnavailableError
from stellarax.core.op import Op as Op
from stellarax.core.partitioning import ShardingLayout as ShardingLayout
from stellarax.core.partitioning import per_shard_scope as per_shard_scope
from stellarax.ops.attention.api import dot_product_attention as dot_product_attention
from stellarax.ops.attention.base import XlaAttention as XlaAttention
from stellarax.ops.attention.base import XlaAttentionVjp as XlaAttentionVjp
from stellarax.ops.attention.base import XlaChunkedAttention as XlaChunkedAttention
from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttention as PallasMosaicGpuAttention
from stellarax.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuAttentionVjp as PallasMosaicGpuAttentionVjp
from stellarax.ops.attention.pallas_triton import PallasTritonAttention as PallasTritonAttention
from stellarax.ops.attention.pallas_triton import PallasTritonAttentionVjp as PallasTritonAttentionVjp
from stellarax.ops.gated_linear_unit.api import gated_linear_unit as gated_linear_unit
from stellarax.ops.gated_linear_unit.base import XlaGatedLinearUnit as XlaGatedLinearUnit
from stellarax.ops.gated_linear_unit.base import XlaGatedLinearUnitVjp as XlaGatedLinearUnitVjp
from stellarax.ops.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit as PallasTritonGatedLinearUnit
from stellarax.ops.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnitVjp as PallasTritonGatedLinearUnitVjp
from stellarax.ops.normalization.api import layer_norm as layer_norm
from stellarax.ops.normalization.api import rms_norm as rms_norm
from stellarax.ops.normalization.base import XlaLayerNorm as XlaLayerNorm
from stellarax.ops.normalization.base import XlaLayerNormVjp as XlaLayerNormVjp
from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNorm as PallasTritonLayerNorm
from stellarax.ops.normalization.pallas_triton import PallasTritonLayerNormVjp as PallasTritonLayerNormVjp
from stellarax.ops.ragged_dot.api import ragged_dot as ragged_dot
from stellarax.ops.ragged_dot.base import XlaRaggedDot as XlaRaggedDot
from stellarax.ops.ragged_dot.base import XlaRaggedDotVjp as XlaRaggedDotVjp
from stellarax.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot as PallasMosaicGpuRaggedDot
from stellarax.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDotVjp as PallasMosaicGpuRaggedDotVjp
from stellarax.ops.ragged_dot.pallas_triton import PallasTritonRaggedDot as PallasTritonRaggedDot
from stellarax.ops.ragged_dot.pallas_triton import PallasTritonRaggedDotVjp as PallasTritonRaggedDotVjp
