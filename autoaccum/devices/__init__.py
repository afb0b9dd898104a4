"""Devices: profiles, detection, set-up before JAX starts, deviceless GPU targets, meshes, and
how a real out-of-memory looks. The lowest layer: it imports nothing else of autoaccum.

``_quiet`` is imported first: on a machine without a GPU it sets what keeps JAX and TensorFlow
quiet before anything imports them (``QUIET_START`` says what it set).
"""

from ._quiet import QUIET_START as QUIET_START

# isort: split
from ._configure import configure as configure
from ._detect import DetectedDevice as DetectedDevice
from ._detect import detect_device as detect_device
from ._detect import host_memory as host_memory
from ._deviceless import DevicelessTarget as DevicelessTarget
from ._deviceless import deviceless_target as deviceless_target
from ._extras import MissingExtraError as MissingExtraError
from ._extras import require_extra as require_extra
from ._margins import Margin as Margin
from ._margins import command_buffers_enabled as command_buffers_enabled
from ._margins import environment_memory_fraction as environment_memory_fraction
from ._mesh import data_parallel_mesh as data_parallel_mesh
from ._mesh import replicate as replicate
from ._mesh import resolve_mesh as resolve_mesh
from ._mesh import shard_batches as shard_batches
from ._oom import is_out_of_memory as is_out_of_memory
from ._profiles import DeviceProfile as DeviceProfile
from ._profiles import find_profile as find_profile
from ._profiles import list_profiles as list_profiles
from ._rlimit import AddressSpaceCap as AddressSpaceCap
from ._units import format_bytes as format_bytes
from ._warnings import AutoaccumWarning as AutoaccumWarning

__all__ = [
    "AddressSpaceCap",
    "AutoaccumWarning",
    "QUIET_START",
    "DetectedDevice",
    "DeviceProfile",
    "DevicelessTarget",
    "MissingExtraError",
    "Margin",
    "command_buffers_enabled",
    "configure",
    "data_parallel_mesh",
    "detect_device",
    "deviceless_target",
    "environment_memory_fraction",
    "find_profile",
    "format_bytes",
    "host_memory",
    "is_out_of_memory",
    "list_profiles",
    "replicate",
    "require_extra",
    "resolve_mesh",
    "shard_batches",
]
