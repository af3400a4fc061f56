"""Autotuning: find, keep and apply the fastest config of every op call."""

from stellarax.autotuning.autotuner import Autotuner as Autotuner
from stellarax.autotuning.autotuner import IncompleteTuningError as IncompleteTuningError
from stellarax.autotuning.autotuner import autotune as autotune
from stellarax.autotuning.cache import LIBRARY_CACHE as LIBRARY_CACHE
from stellarax.autotuning.cache import USER_CACHE as USER_CACHE
from stellarax.autotuning.cache import user_cache_root as user_cache_root
from stellarax.autotuning.capture import bound_args_from_json as bound_args_from_json
from stellarax.autotuning.capture import bound_args_to_json as bound_args_to_json
from stellarax.autotuning.capture import get_bound_args as get_bound_args
from stellarax.autotuning.distributed import DistributedTuningError as DistributedTuningError
from stellarax.autotuning.distributed import check_consistent as check_consistent
from stellarax.autotuning.explain import Explanation as Explanation
from stellarax.autotuning.explain import explain as explain
from stellarax.autotuning.file_format import FormatError as FormatError
from stellarax.autotuning.file_format import VersionWarning as VersionWarning
from stellarax.autotuning.heuristics_fit import fit_heuristics as fit_heuristics
from stellarax.autotuning.in_program import ProgramCheck as ProgramCheck
from stellarax.autotuning.in_program import check_in_program as check_in_program
from stellarax.autotuning.measure import Measurement as Measurement
from stellarax.autotuning.measure import MeasureOptions as MeasureOptions
from stellarax.autotuning.result import AutotuningResult as AutotuningResult
from stellarax.autotuning.result import Entry as Entry
from stellarax.autotuning.transfer import transfer_scope as transfer_scope
from stellarax.core.bound_args import BoundArguments as BoundArguments
from stellarax.core.resolution import ConfigMissError as ConfigMissError
from stellarax.core.resolution import miss_policy_scope as miss_policy_scope
