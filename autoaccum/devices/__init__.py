"""Devices: profiles, detection, set-up before JAX starts, deviceless GPU targets, meshes, and
how a real out-of-memory looks. The lowest layer: it imports nothing else of autoaccum.

Every name is imported when first used, so :func:`configure` can run before anything imports
JAX; :func:`quiet_start` keeps JAX and TensorFlow quiet on a machine without a GPU.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers and the docs
    from ._configure import configure as configure
    from ._detect import DetectedDevice as DetectedDevice
    from ._detect import detect_device as detect_device
    from ._extras import MissingExtraError as MissingExtraError
    from ._extras import require_extra as require_extra
    from ._oom import is_out_of_memory as is_out_of_memory
    from ._profiles import DeviceProfile as DeviceProfile
    from ._profiles import find_profile as find_profile
    from ._profiles import format_bytes as format_bytes
    from ._profiles import list_profiles as list_profiles
    from ._quiet import quiet_start as quiet_start
    from ._warnings import AutoaccumWarning as AutoaccumWarning

__getattr__, __dir__ = lazy_exports(__name__, {
    "quiet_start": "._configure",
    "configure": "._configure",
    "DetectedDevice": "._detect",
    "detect_device": "._detect",
    "MissingExtraError": "._extras",
    "require_extra": "._extras",
    "is_out_of_memory": "._oom",
    "DeviceProfile": "._profiles",
    "find_profile": "._profiles",
    "list_profiles": "._profiles",
    "format_bytes": "._profiles",
    "AutoaccumWarning": "._warnings",
})

__all__ = [
    "AutoaccumWarning",
    "quiet_start",
    "DetectedDevice",
    "DeviceProfile",
    "MissingExtraError",
    "configure",
    "detect_device",
    "find_profile",
    "format_bytes",
    "is_out_of_memory",
    "list_profiles",
    "require_extra",
]
