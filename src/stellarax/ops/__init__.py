"""The op families. Importing this package registers every shipped op."""

from stellarax.ops.attention import base as _attention_base  # noqa: F401
from stellarax.ops.attention import pallas_mosaic_gpu as _attention_pallas_mosaic_gpu  # noqa: F401
from stellarax.ops.attention import pallas_triton as _attention_pallas_triton  # noqa: F401
from stellarax.ops.gated_linear_unit import base as _glu_base  # noqa: F401
from stellarax.ops.gated_linear_unit import pallas_triton as _glu_pallas_triton  # noqa: F401
from stellarax.ops.normalization import base as _normalization_base  # noqa: F401
from stellarax.ops.normalization import pallas_triton as _normalization_pallas_triton  # noqa: F401
from stellarax.ops.ragged_dot import base as _ragged_dot_base  # noqa: F401
from stellarax.ops.ragged_dot import pallas_mosaic_gpu as _ragged_dot_pallas_mosaic_gpu  # noqa: F401
from stellarax.ops.ragged_dot import pallas_triton as _ragged_dot_pallas_triton  # noqa: F401
