"""Vulkan host plumbing for the vulkan backend, on the raw cffi layer of the ``vulkan`` package.

Everything goes through ``vulkan.ffi``/``vulkan.lib`` directly rather than the package's
Python wrappers, so this module owns every struct's lifetime: each ``ffi.new`` that a call
reads is held in a local (or in ``keep``) until the call returns, nested structs included
(the cffi wrappers keep only pointer fields alive). Sizes are always passed explicitly
(``VK_WHOLE_SIZE`` overflows in the bindings) and every ``VkResult`` is checked; device loss
and memory exhaustion become :class:`~mmad.errors.LaunchError` with the driver's result name.

Pieces: :func:`probe_devices` (quick, read-only survey of every physical device),
:class:`Device` (instance, device, compute queue, command pool, fence), :class:`Buffer`
(device-local storage buffers with a staging path, or host-visible mapped ones),
:class:`Pipeline` (SPIR-V + specialization constants + push-constant range) and
:class:`Program` (a command buffer recorded once with its descriptor sets and re-submitted).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from mmad.backends.vulkan import nvstructs as nv
from mmad.errors import BackendUnavailable, CompileError, LaunchError

try:
    import vulkan as _vk
    ffi, lib = _vk.ffi, _vk.lib
    IMPORT_ERROR = ""
except (ImportError, OSError) as exc:  # OSError: the package is there but no libvulkan.so.1
    _vk = None
    ffi = lib = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

API_VERSION_1_2 = (1 << 22) | (2 << 12)
DEVICE_TYPE_RANK = {2: 0, 1: 1, 3: 2, 4: 3, 0: 4}  # discrete > integrated > virtual > cpu > other
DEVICE_TYPE_NAME = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
COMPONENT_TYPE = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64",
                  7: "u8", 8: "u16", 9: "u32", 10: "u64", 1000141000: "bf16",
                  1000491000: "s8packed", 1000491001: "u8packed", 1000491002: "e4m3", 1000491003: "e5m2"}
SCOPE = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}
COOPMAT_EXT = "VK_KHR_cooperative_matrix"
# NVIDIA's workgroup-scope matrices, flexible dimensions, conversions and tensor addressing (the
# coopmat2 variant); its structures are declared in nvstructs (the bindings predate them)
COOPMAT2_EXT = nv.EXTENSION
ATOMIC_FLOAT_EXT = "VK_EXT_shader_atomic_float"  # atomicAdd on fp32 in storage buffers (grid gradients)
# a pipeline's subgroup size pinned (core in Vulkan 1.3): the cooperative-matrix kernels count their
# subgroups (gl_SubgroupID) by the probed size, which a driver free to pick another (Intel's 8/16/32,
# AMD's wave32/64) would break
SUBGROUP_SIZE_EXT = "VK_EXT_subgroup_size_control"

# VkStructureType values used below (core 1.0-1.2 plus the cooperative-matrix extension)
ST = {
    "app": 0, "instance": 1, "queue": 2, "device": 3, "submit": 4, "alloc": 5, "fence": 8,
    "buffer": 12, "shader": 16, "stage": 18, "compute_pipeline": 29, "pipeline_layout": 30,
    "dsl": 32, "pool": 33, "ds_alloc": 34, "write_ds": 35, "cmd_pool": 39, "cb_alloc": 40,
    "cb_begin": 42, "mem_barrier": 46, "features2": 1000059000, "properties2": 1000059001,
    "subgroup_props": 1000094000, "vk11_features": 49, "vk12_features": 51,
    "coopmat_features": 1000506000, "coopmat_props": 1000506001, "query_pool": 11,
    "exec_features": 1000269000, "pipeline_info": 1000269001, "exec_props": 1000269002,
    "exec_info": 1000269003, "exec_stat": 1000269004,
    "memory_props2": 1000059006, "memory_budget": 1000237000, "atomic_float_features": 1000260000,
    "subgroup_size_props": 1000225000, "required_subgroup_size": 1000225001, "subgroup_size_features": 1000225002,
}
BUDGET_EXT = "VK_EXT_memory_budget"
STATS_EXT = "VK_KHR_pipeline_executable_properties"


def _result_name(code: int) -> str:
    if _vk is not None:
        for name in ("VK_ERROR_DEVICE_LOST", "VK_ERROR_OUT_OF_DEVICE_MEMORY", "VK_ERROR_OUT_OF_HOST_MEMORY",
                     "VK_ERROR_INITIALIZATION_FAILED", "VK_ERROR_EXTENSION_NOT_PRESENT",
                     "VK_ERROR_FEATURE_NOT_PRESENT", "VK_ERROR_INCOMPATIBLE_DRIVER",
                     "VK_ERROR_TOO_MANY_OBJECTS", "VK_ERROR_INVALID_SHADER_NV", "VK_TIMEOUT",
                     "VK_ERROR_FRAGMENTED_POOL", "VK_ERROR_OUT_OF_POOL_MEMORY", "VK_ERROR_UNKNOWN"):
            if getattr(_vk, name, None) == code:
                return name
    return f"VkResult {code}"


def check(code: int, what: str) -> None:
    """Raise :class:`LaunchError` naming the call and the driver's result unless it succeeded."""
    if code != 0:
        raise LaunchError(f"{what} failed: {_result_name(code)}")


def require_vulkan() -> None:
    if _vk is None:
        raise BackendUnavailable("vulkan", f"the vulkan Python package cannot load: {IMPORT_ERROR}")


def _cstr(chars: Any) -> str:
    return ffi.string(chars).decode("utf-8", "replace")


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


# -- instance & survey ---------------------------------------------------------------------
def _create_instance() -> Any:
    app_name = ffi.new("char[]", b"mmad")
    app = ffi.new("VkApplicationInfo*")
    app.sType = ST["app"]
    app.pApplicationName = app_name
    app.pEngineName = app_name
    app.apiVersion = API_VERSION_1_2
    info = ffi.new("VkInstanceCreateInfo*")
    info.sType = ST["instance"]
    info.pApplicationInfo = app
    out = ffi.new("VkInstance*")
    check(lib.vkCreateInstance(info, ffi.NULL, out), "vkCreateInstance")
    return out[0]


def _physical_devices(instance: Any) -> list[Any]:
    count = ffi.new("uint32_t*")
    check(lib.vkEnumeratePhysicalDevices(instance, count, ffi.NULL), "vkEnumeratePhysicalDevices")
    handles = ffi.new("VkPhysicalDevice[]", count[0])
    check(lib.vkEnumeratePhysicalDevices(instance, count, handles), "vkEnumeratePhysicalDevices")
    return [handles[i] for i in range(count[0])]


def _extensions(pd: Any) -> set[str]:
    count = ffi.new("uint32_t*")
    check(lib.vkEnumerateDeviceExtensionProperties(pd, ffi.NULL, count, ffi.NULL), "vkEnumerateDeviceExtensionProperties")
    props = ffi.new("VkExtensionProperties[]", count[0])
    check(lib.vkEnumerateDeviceExtensionProperties(pd, ffi.NULL, count, props), "vkEnumerateDeviceExtensionProperties")
    return {_cstr(props[i].extensionName) for i in range(count[0])}


def _coopmat_shapes(instance: Any, pd: Any) -> list[dict[str, Any]]:
    """The raw cooperative-matrix property list; only call once the extension is listed."""
    ptr = lib.vkGetInstanceProcAddr(instance, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    if ptr == ffi.NULL:
        return []
    fn = ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", ptr)
    count = ffi.new("uint32_t*")
    check(fn(pd, count, ffi.NULL), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    props = ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = ST["coopmat_props"]  # the package's wrapper leaves sType unset
    check(fn(pd, count, props), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    shapes = []
    for i in range(count[0]):
        p = props[i]
        shapes.append({"m": p.MSize, "n": p.NSize, "k": p.KSize,
                       "a": COMPONENT_TYPE.get(p.AType, str(p.AType)),
                       "b": COMPONENT_TYPE.get(p.BType, str(p.BType)),
                       "c": COMPONENT_TYPE.get(p.CType, str(p.CType)),
                       "result": COMPONENT_TYPE.get(p.ResultType, str(p.ResultType)),
                       "scope": SCOPE.get(p.scope, str(p.scope))})
    return shapes


@dataclass
class DeviceInfo:
    """What the survey learned about one physical device."""

    index: int
    name: str
    device_type: str
    api_version: str
    driver: str
    subgroup_size: int
    max_shared_bytes: int
    max_workgroup_invocations: int
    max_group_count: tuple[int, int, int]
    max_storage_range: int
    timestamp_period_ns: float
    shader_float16: bool
    storage_16bit: bool
    vulkan_memory_model: bool
    extensions: set[str] = field(repr=False, default_factory=set)
    coopmat_shapes: list[dict[str, Any]] = field(default_factory=list)
    float32_atomic_add: bool = False  # shaderBufferFloat32AtomicAdd (VK_EXT_shader_atomic_float)
    # (min, max) subgroup sizes a compute pipeline may require (SUBGROUP_SIZE_EXT), None without it
    subgroup_size_range: tuple[int, int] | None = None
    full_subgroups: bool = False  # computeFullSubgroups: every subgroup of a workgroup complete
    # VK_NV_cooperative_matrix2 where offered: its features (nvstructs.FEATURES: bool), properties
    # (nvstructs.PROPERTIES: int) and flexible-dimension shapes (m/n/k granularity, types, scope,
    # workgroup invocations)
    coopmat2_features: dict[str, bool] = field(default_factory=dict)
    coopmat2_properties: dict[str, int] = field(default_factory=dict)
    coopmat2_shapes: list[dict[str, Any]] = field(default_factory=list)
    # VK_NV_cooperative_vector where offered (surveyed for the probe; no variant uses it): features,
    # properties and the type combinations (input, its interpretation, matrix, bias, result, transpose)
    coopvec_features: dict[str, bool] = field(default_factory=dict)
    coopvec_properties: dict[str, int] = field(default_factory=dict)
    coopvec_combinations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def software(self) -> bool:
        return self.device_type == "cpu"

    @property
    def rank(self) -> int:
        order = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3}
        return order.get(self.device_type, 4)


def _survey(instance: Any, index: int, pd: Any) -> DeviceInfo:
    props = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(pd, props)
    extensions = _extensions(pd)
    subgroup = ffi.new("VkPhysicalDeviceSubgroupProperties*")
    subgroup.sType = ST["subgroup_props"]
    size_control = ffi.new("VkPhysicalDeviceSubgroupSizeControlProperties*")
    size_control.sType = ST["subgroup_size_props"]
    has_size_control = SUBGROUP_SIZE_EXT in extensions or props.apiVersion >= (1 << 22 | 3 << 12)
    if has_size_control:
        subgroup.pNext = size_control
    coopmat2 = COOPMAT2_EXT in extensions
    cm2_props = nv.new("VkPhysicalDeviceCooperativeMatrix2PropertiesNV") if coopmat2 else None
    cm2_features = nv.new("VkPhysicalDeviceCooperativeMatrix2FeaturesNV") if coopmat2 else None
    coopvec = nv.VECTOR_EXTENSION in extensions
    cv_props = nv.new("VkPhysicalDeviceCooperativeVectorPropertiesNV") if coopvec else None
    cv_features = nv.new("VkPhysicalDeviceCooperativeVectorFeaturesNV") if coopvec else None
    tail = size_control if has_size_control else subgroup
    for extra in (cm2_props, cv_props):  # appended at the chain's end
        if extra is not None:
            tail.pNext = extra
            tail = extra
    props2 = ffi.new("VkPhysicalDeviceProperties2*")
    props2.sType = ST["properties2"]
    props2.pNext = subgroup
    lib.vkGetPhysicalDeviceProperties2(pd, props2)
    f12 = ffi.new("VkPhysicalDeviceVulkan12Features*")
    f12.sType = ST["vk12_features"]
    f11 = ffi.new("VkPhysicalDeviceVulkan11Features*")
    f11.sType = ST["vk11_features"]
    f11.pNext = f12
    atomic = None
    if ATOMIC_FLOAT_EXT in extensions:
        atomic = ffi.new("VkPhysicalDeviceShaderAtomicFloatFeaturesEXT*")
        atomic.sType = ST["atomic_float_features"]
        f12.pNext = atomic
    size_features = ffi.new("VkPhysicalDeviceSubgroupSizeControlFeatures*")
    size_features.sType = ST["subgroup_size_features"]
    if has_size_control:
        size_features.pNext = f12.pNext
        f12.pNext = size_features
    chain_head = f11
    for extra in (cm2_features, cv_features):  # prepended: each points at the chain so far
        if extra is not None:
            extra.pNext = chain_head
            chain_head = extra
    feats = ffi.new("VkPhysicalDeviceFeatures2*")
    feats.sType = ST["features2"]
    feats.pNext = chain_head
    lib.vkGetPhysicalDeviceFeatures2(pd, feats)
    limits = props.limits
    info = DeviceInfo(
        index=index, name=_cstr(props.deviceName),
        device_type=DEVICE_TYPE_NAME.get(props.deviceType, "other"),
        api_version=_version(props.apiVersion), driver=f"{props.driverVersion:#x}",
        subgroup_size=int(subgroup.subgroupSize),
        max_shared_bytes=int(limits.maxComputeSharedMemorySize),
        max_workgroup_invocations=int(limits.maxComputeWorkGroupInvocations),
        max_group_count=tuple(int(limits.maxComputeWorkGroupCount[i]) for i in range(3)),
        max_storage_range=int(limits.maxStorageBufferRange),
        timestamp_period_ns=float(limits.timestampPeriod),
        shader_float16=bool(f12.shaderFloat16), storage_16bit=bool(f11.storageBuffer16BitAccess),
        vulkan_memory_model=bool(f12.vulkanMemoryModel),
        extensions=extensions, float32_atomic_add=atomic is not None and bool(atomic.shaderBufferFloat32AtomicAdd))
    if has_size_control and size_features.subgroupSizeControl and size_control.requiredSubgroupSizeStages & 0x20:
        info.subgroup_size_range = (int(size_control.minSubgroupSize), int(size_control.maxSubgroupSize))
        info.full_subgroups = bool(size_features.computeFullSubgroups)
    if COOPMAT_EXT in extensions:
        info.coopmat_shapes = _coopmat_shapes(instance, pd)
    if coopmat2:
        info.coopmat2_features = {name: bool(getattr(cm2_features, name)) for name in nv.FEATURES}
        info.coopmat2_properties = {name: int(getattr(cm2_props, name)) for name in nv.PROPERTIES}
        info.coopmat2_shapes = _flexible_shapes(instance, pd)
    if coopvec:
        info.coopvec_features = {name: bool(getattr(cv_features, name)) for name in nv.VECTOR_FEATURES}
        info.coopvec_properties = {name: int(getattr(cv_props, name)) for name in nv.VECTOR_PROPERTIES}
        try:
            raw = nv.vector_combinations(lib.vkGetInstanceProcAddr, instance, pd, ffi)
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from exc
        info.coopvec_combinations = [{**{k: COMPONENT_TYPE.get(v, str(v)) for k, v in c.items() if k != "transpose"},
                                      "transpose": bool(c["transpose"])} for c in raw]
    return info


def _flexible_shapes(instance: Any, pd: Any) -> list[dict[str, Any]]:
    """VK_NV_cooperative_matrix2's flexible-dimension shapes, named as _coopmat_shapes names its."""
    try:
        raw = nv.flexible_dimensions(lib.vkGetInstanceProcAddr, instance, pd, ffi)
    except RuntimeError as exc:
        raise LaunchError(str(exc)) from exc
    return [{"m": p["MGranularity"], "n": p["NGranularity"], "k": p["KGranularity"],
             "a": COMPONENT_TYPE.get(p["AType"], str(p["AType"])), "b": COMPONENT_TYPE.get(p["BType"], str(p["BType"])),
             "c": COMPONENT_TYPE.get(p["CType"], str(p["CType"])),
             "result": COMPONENT_TYPE.get(p["ResultType"], str(p["ResultType"])),
             "saturating": bool(p["saturatingAccumulation"]), "scope": SCOPE.get(p["scope"], str(p["scope"])),
             "workgroup_invocations": p["workgroupInvocations"]} for p in raw]


def probe_devices() -> list[DeviceInfo]:
    """Every physical device, best first (discrete > integrated > virtual > cpu)."""
    require_vulkan()
    instance = _create_instance()
    try:
        infos = [_survey(instance, i, pd) for i, pd in enumerate(_physical_devices(instance))]
    finally:
        lib.vkDestroyInstance(instance, ffi.NULL)
    return sorted(infos, key=lambda d: (d.rank, d.index))


# -- device --------------------------------------------------------------------------------
class Device:
    """An open logical device with one compute queue; close() releases everything."""

    def __init__(self, info: DeviceInfo, enable_coopmat: bool = False, pipeline_stats: bool = False,
                 enable_coopmat2: bool = False):
        """``enable_coopmat2``: with VK_NV_cooperative_matrix2 and every one of its features the
        device offers (it builds on VK_KHR_cooperative_matrix, which ``enable_coopmat`` enables)."""
        require_vulkan()
        self.info = info
        # compiler statistics of every pipeline (registers, spills...), where the driver has them
        self.pipeline_stats = pipeline_stats and STATS_EXT in info.extensions
        self.instance = _create_instance()
        self.closed = False
        self.coopmat2 = enable_coopmat2 and COOPMAT2_EXT in info.extensions  # enabled on this device
        try:
            self.physical = _physical_devices(self.instance)[info.index]
            self._open(enable_coopmat, self.coopmat2)
        except BaseException:
            lib.vkDestroyInstance(self.instance, ffi.NULL)
            raise

    def _open(self, enable_coopmat: bool, enable_coopmat2: bool) -> None:
        count = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self.physical, count, ffi.NULL)
        families = ffi.new("VkQueueFamilyProperties[]", count[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self.physical, count, families)
        compute = [i for i in range(count[0]) if families[i].queueFlags & 0x2]
        if not compute:
            raise LaunchError(f"{self.info.name} has no compute queue family")
        # a compute-only family first (no graphics bit), else any with compute
        self.queue_family = sorted(compute, key=lambda i: bool(families[i].queueFlags & 0x1))[0]
        priority = ffi.new("float[]", [1.0])
        queue_info = ffi.new("VkDeviceQueueCreateInfo*")
        queue_info.sType = ST["queue"]
        queue_info.queueFamilyIndex = self.queue_family
        queue_info.queueCount = 1
        queue_info.pQueuePriorities = priority
        f12 = ffi.new("VkPhysicalDeviceVulkan12Features*")
        f12.sType = ST["vk12_features"]
        f12.shaderFloat16 = int(self.info.shader_float16)
        f12.vulkanMemoryModel = int(self.info.vulkan_memory_model)  # the coopmat SPIR-V declares it
        f11 = ffi.new("VkPhysicalDeviceVulkan11Features*")
        f11.sType = ST["vk11_features"]
        f11.storageBuffer16BitAccess = int(self.info.storage_16bit)
        f11.pNext = f12
        # the extensions asked for, each with its feature struct chained after f12 (held here until
        # vkCreateDevice returns); atomic float adds wherever offered: a grid model's table gradient uses them
        ext_names, features = [], []
        for enabled, ctype, stype, feature, ext in (
                (enable_coopmat, "VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", "coopmat_features",
                 "cooperativeMatrix", COOPMAT_EXT),
                (self.info.float32_atomic_add, "VkPhysicalDeviceShaderAtomicFloatFeaturesEXT*", "atomic_float_features",
                 "shaderBufferFloat32AtomicAdd", ATOMIC_FLOAT_EXT),
                (self.pipeline_stats, "VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR*", "exec_features",
                 "pipelineExecutableInfo", STATS_EXT),
                (self.info.subgroup_size_range is not None, "VkPhysicalDeviceSubgroupSizeControlFeatures*",
                 "subgroup_size_features", "subgroupSizeControl", SUBGROUP_SIZE_EXT)):
            if enabled:
                struct = ffi.new(ctype)
                struct.sType = ST[stype]
                setattr(struct, feature, 1)
                if ext == SUBGROUP_SIZE_EXT:
                    struct.computeFullSubgroups = int(self.info.full_subgroups)
                struct.pNext = f12.pNext
                f12.pNext = struct
                features.append(struct)
                if ext in self.info.extensions:  # core in Vulkan 1.3: the feature alone
                    ext_names.append(ffi.new("char[]", ext.encode()))
        if enable_coopmat2:  # its structure comes from nvstructs' FFI: a raw pointer in the chain
            offered = {name: 1 for name, on in self.info.coopmat2_features.items() if on}
            struct = nv.new("VkPhysicalDeviceCooperativeMatrix2FeaturesNV", **offered)
            struct.pNext = f12.pNext
            f12.pNext = struct
            features.append(struct)
            ext_names.append(ffi.new("char[]", COOPMAT2_EXT.encode()))
        ext_array = ffi.new("char*[]", ext_names) if ext_names else ffi.NULL
        feats = ffi.new("VkPhysicalDeviceFeatures2*")
        feats.sType = ST["features2"]
        feats.pNext = f11
        info = ffi.new("VkDeviceCreateInfo*")
        info.sType = ST["device"]
        info.pNext = feats
        info.queueCreateInfoCount = 1
        info.pQueueCreateInfos = queue_info
        info.enabledExtensionCount = len(ext_names)
        info.ppEnabledExtensionNames = ext_array
        out = ffi.new("VkDevice*")
        check(lib.vkCreateDevice(self.physical, info, ffi.NULL, out), f"vkCreateDevice on {self.info.name}")
        self.device = out[0]
        queue = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, self.queue_family, 0, queue)
        self.queue = queue[0]
        pool_info = ffi.new("VkCommandPoolCreateInfo*")
        pool_info.sType = ST["cmd_pool"]
        pool_info.flags = 0x2  # RESET_COMMAND_BUFFER
        pool_info.queueFamilyIndex = self.queue_family
        pool = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(self.device, pool_info, ffi.NULL, pool), "vkCreateCommandPool")
        self.command_pool = pool[0]
        fence_info = ffi.new("VkFenceCreateInfo*")
        fence_info.sType = ST["fence"]
        fence = ffi.new("VkFence*")
        check(lib.vkCreateFence(self.device, fence_info, ffi.NULL, fence), "vkCreateFence")
        self.fence = fence[0]
        mem = ffi.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(self.physical, mem)
        self.memory_types = [(mem.memoryTypes[i].propertyFlags, mem.memoryTypes[i].heapIndex)
                             for i in range(mem.memoryTypeCount)]
        self.bytes_allocated = 0
        self._staging: Buffer | None = None
        self.lock = threading.RLock()  # one queue: submissions and staging are serialised

    # -- memory ---------------------------------------------------------------------------
    def memory_type(self, type_bits: int, host_visible: bool, cached: bool = False) -> int:
        """The memory type for a buffer: DEVICE_LOCAL, or HOST_VISIBLE|HOST_COHERENT (``cached``:
        HOST_CACHED too where the device offers it: the CPU reads uncached memory — NVIDIA's
        first host-visible type — at a few hundred MB/s, which makes reading a 65,536-row model-M
        output back through uncached staging memory take ~55 ms on an H100)."""
        wants = [0x2 | 0x4 | 0x8, 0x2 | 0x4] if host_visible and cached else [0x2 | 0x4] if host_visible else [0x1]
        for want in wants:
            for i, (flags, _) in enumerate(self.memory_types):
                if type_bits & (1 << i) and flags & want == want:
                    return i
        for i, (flags, _) in enumerate(self.memory_types):  # device-local not offered: any
            if type_bits & (1 << i) and (not host_visible or flags & 0x6 == 0x6):
                return i
        raise LaunchError(f"{self.info.name} offers no suitable memory type (bits {type_bits:#x})")

    def free_device_local_bytes(self) -> int | None:
        """Budget minus usage of the device-local heaps (VK_EXT_memory_budget: the driver's
        view of what this process may still allocate), or None where the device does not
        offer the extension (core Vulkan reports only heap sizes, not what is in use)."""
        if BUDGET_EXT not in self.info.extensions:
            return None
        budget = ffi.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT*")
        budget.sType = ST["memory_budget"]
        props = ffi.new("VkPhysicalDeviceMemoryProperties2*")
        props.sType = ST["memory_props2"]
        props.pNext = budget
        lib.vkGetPhysicalDeviceMemoryProperties2(self.physical, props)
        mem = props.memoryProperties
        local = [i for i in range(mem.memoryHeapCount) if mem.memoryHeaps[i].flags & 0x1]  # DEVICE_LOCAL
        heaps = local or list(range(mem.memoryHeapCount))
        return int(max(max(0, int(budget.heapBudget[i]) - int(budget.heapUsage[i])) for i in heaps))

    def buffer(self, nbytes: int, host_visible: bool = False) -> "Buffer":
        return Buffer(self, nbytes, host_visible)

    def memory_type_flags(self, buffer: "Buffer") -> int:
        """The property flags of the memory type a buffer was given (for tests and the probe)."""
        return self.memory_types[buffer.memory_type][0]

    def staging(self, nbytes: int) -> "Buffer":
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self._staging.free()
            self._staging = Buffer(self, max(nbytes, 1 << 20), host_visible=True, cached=True)
        return self._staging

    # -- command submission ---------------------------------------------------------------
    def allocate_command_buffer(self) -> Any:
        alloc = ffi.new("VkCommandBufferAllocateInfo*")
        alloc.sType = ST["cb_alloc"]
        alloc.commandPool = self.command_pool
        alloc.level = 0
        alloc.commandBufferCount = 1
        out = ffi.new("VkCommandBuffer*")
        check(lib.vkAllocateCommandBuffers(self.device, alloc, out), "vkAllocateCommandBuffers")
        return out[0]

    def submit(self, command_buffers: Sequence[Any], wait: bool = True) -> None:
        """Submit and (by default) wait on the fence; device loss surfaces here."""
        handles = ffi.new("VkCommandBuffer[]", list(command_buffers))
        info = ffi.new("VkSubmitInfo*")
        info.sType = ST["submit"]
        info.commandBufferCount = len(command_buffers)
        info.pCommandBuffers = handles
        fences = ffi.new("VkFence[]", [self.fence])
        with self.lock:
            check(lib.vkResetFences(self.device, 1, fences), "vkResetFences")
            check(lib.vkQueueSubmit(self.queue, 1, info, self.fence), "vkQueueSubmit")
            if wait:
                self.wait()

    def wait(self) -> None:
        fences = ffi.new("VkFence[]", [self.fence])
        check(lib.vkWaitForFences(self.device, 1, fences, 1, 2**64 - 1), "vkWaitForFences")

    def wait_idle(self) -> None:
        with self.lock:
            check(lib.vkQueueWaitIdle(self.queue), "vkQueueWaitIdle")

    def one_shot(self, record) -> None:
        """Record commands with ``record(cb)`` into a fresh command buffer, run it, wait."""
        with self.lock:
            self._one_shot(record)

    def _one_shot(self, record) -> None:
        cb = self.allocate_command_buffer()
        try:
            begin = ffi.new("VkCommandBufferBeginInfo*")
            begin.sType = ST["cb_begin"]
            begin.flags = 0x1  # ONE_TIME_SUBMIT
            check(lib.vkBeginCommandBuffer(cb, begin), "vkBeginCommandBuffer")
            record(cb)
            check(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
            self.submit([cb])
        finally:
            cbs = ffi.new("VkCommandBuffer[]", [cb])
            lib.vkFreeCommandBuffers(self.device, self.command_pool, 1, cbs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        lib.vkDeviceWaitIdle(self.device)
        if self._staging is not None:
            self._staging.free()
        lib.vkDestroyFence(self.device, self.fence, ffi.NULL)
        lib.vkDestroyCommandPool(self.device, self.command_pool, ffi.NULL)
        lib.vkDestroyDevice(self.device, ffi.NULL)
        lib.vkDestroyInstance(self.instance, ffi.NULL)


def full_barrier(cb: Any) -> None:
    """Make every earlier shader/transfer write visible to every later shader/transfer access."""
    barrier = ffi.new("VkMemoryBarrier*")
    barrier.sType = ST["mem_barrier"]
    barrier.srcAccessMask = 0x40 | 0x1000 | 0x20 | 0x800  # SHADER_WRITE | TRANSFER_WRITE | SHADER_READ | TRANSFER_READ
    barrier.dstAccessMask = 0x20 | 0x40 | 0x800 | 0x1000 | 0x2000  # + HOST_READ
    stages = 0x800 | 0x1000  # COMPUTE_SHADER | TRANSFER
    lib.vkCmdPipelineBarrier(cb, stages, stages | 0x4000, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)


class Buffer:
    """A storage buffer; host-visible ones stay mapped, device-local ones go through staging."""

    def __init__(self, device: Device, nbytes: int, host_visible: bool = False, cached: bool = False):
        self.device = device
        self.size = max(int(nbytes), 16)
        self.host_visible = host_visible
        dev = device.device
        info = ffi.new("VkBufferCreateInfo*")
        info.sType = ST["buffer"]
        info.size = self.size
        info.usage = 0x20 | 0x1 | 0x2  # STORAGE | TRANSFER_SRC | TRANSFER_DST
        out = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev, info, ffi.NULL, out), f"vkCreateBuffer ({self.size} bytes)")
        self.handle = out[0]
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev, self.handle, req)
        alloc = ffi.new("VkMemoryAllocateInfo*")
        alloc.sType = ST["alloc"]
        alloc.allocationSize = req.size
        self.memory_type = alloc.memoryTypeIndex = device.memory_type(req.memoryTypeBits, host_visible, cached)
        mem = ffi.new("VkDeviceMemory*")
        code = lib.vkAllocateMemory(dev, alloc, ffi.NULL, mem)
        if code != 0:
            lib.vkDestroyBuffer(dev, self.handle, ffi.NULL)
            check(code, f"vkAllocateMemory ({req.size} bytes)")
        self.memory = mem[0]
        check(lib.vkBindBufferMemory(dev, self.handle, self.memory, 0), "vkBindBufferMemory")
        self.allocated = int(req.size)
        device.bytes_allocated += self.allocated
        self.mapped = None
        if host_visible:
            ptr = ffi.new("void**")
            check(lib.vkMapMemory(dev, self.memory, 0, self.size, 0, ptr), "vkMapMemory")
            self.mapped = ffi.buffer(ptr[0], self.size)

    def write(self, data: np.ndarray | bytes, offset: int = 0) -> None:
        raw = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        self.write_with(lambda view: view.__setitem__(slice(None), np.frombuffer(raw, np.uint8)), raw.nbytes, offset)

    def write_with(self, fill: Callable[[np.ndarray], None], nbytes: int, offset: int = 0) -> None:
        """Let ``fill`` write ``nbytes`` at ``offset`` into a uint8 array over mapped memory (this
        buffer's, or the staging buffer's, then copied in): no intermediate host array."""
        if offset + nbytes > self.size:
            raise LaunchError(f"write of {nbytes} bytes at {offset} overruns a {self.size}-byte buffer")
        if self.mapped is not None:
            fill(np.frombuffer(self.mapped, np.uint8, nbytes, offset))
            return
        with self.device.lock:
            staging = self.device.staging(nbytes)
            fill(np.frombuffer(staging.mapped, np.uint8, nbytes))
            self.device.one_shot(lambda cb: _copy(cb, staging, self, nbytes, 0, offset))

    def read_with(self, use: Callable[[np.ndarray], None], nbytes: int, offset: int = 0) -> None:
        """Call ``use`` on a uint8 array over ``nbytes`` at ``offset`` in mapped memory (read back
        through the staging buffer for a device-local one); the array is valid during the call."""
        if offset + nbytes > self.size:
            raise LaunchError(f"read of {nbytes} bytes at {offset} overruns a {self.size}-byte buffer")
        if self.mapped is not None:
            use(np.frombuffer(self.mapped, np.uint8, nbytes, offset))
            return
        with self.device.lock:
            staging = self.device.staging(nbytes)
            self.device.one_shot(lambda cb: _copy(cb, self, staging, nbytes, offset, 0))
            use(np.frombuffer(staging.mapped, np.uint8, nbytes))

    def read(self, nbytes: int, offset: int = 0) -> bytes:
        out: list[bytes] = []
        self.read_with(lambda view: out.append(view.tobytes()), nbytes, offset)
        return out[0]

    def fill_zero(self) -> None:
        self.device.one_shot(lambda cb: lib.vkCmdFillBuffer(cb, self.handle, 0, self.size // 4 * 4, 0))

    def free(self) -> None:
        if self.handle is None:
            return
        if self.device.closed:  # destroyed with the device
            self.handle = None
            return
        dev = self.device.device
        if self.mapped is not None:
            lib.vkUnmapMemory(dev, self.memory)
            self.mapped = None
        lib.vkDestroyBuffer(dev, self.handle, ffi.NULL)
        lib.vkFreeMemory(dev, self.memory, ffi.NULL)
        self.device.bytes_allocated -= self.allocated
        self.handle = None


def _copy(cb: Any, src: Buffer, dst: Buffer, nbytes: int, src_offset: int, dst_offset: int) -> None:
    full_barrier(cb)
    region = ffi.new("VkBufferCopy*")
    region.srcOffset = src_offset
    region.dstOffset = dst_offset
    region.size = nbytes
    lib.vkCmdCopyBuffer(cb, src.handle, dst.handle, 1, region)
    full_barrier(cb)


class Pipeline:
    """A compute pipeline over ``n_bindings`` storage buffers (set 0, bindings 0..n-1)."""

    def __init__(self, device: Device, spirv: bytes, n_bindings: int, push_bytes: int = 0,
                 spec_constants: dict[int, int | float] | None = None, name: str = "kernel",
                 subgroup_size: int | None = None):
        """``subgroup_size``: run with exactly that subgroup size, in full subgroups, where the
        device lets a pipeline require one (DeviceInfo.subgroup_size_range); elsewhere the
        driver's choice, which is then the probed size on the devices the kernels are sized for."""
        self.device = device
        self.name = name
        self.n_bindings = n_bindings
        self.push_bytes = push_bytes
        dev = device.device
        code = ffi.new("uint32_t[]", len(spirv) // 4)
        ffi.memmove(code, spirv, len(spirv))
        module_info = ffi.new("VkShaderModuleCreateInfo*")
        module_info.sType = ST["shader"]
        module_info.codeSize = len(spirv)
        module_info.pCode = code
        module = ffi.new("VkShaderModule*")
        result = lib.vkCreateShaderModule(dev, module_info, ffi.NULL, module)
        if result != 0:  # the driver refused the SPIR-V: a compile failure, in its words
            raise CompileError(f"pipeline {name}", f"vkCreateShaderModule failed: {_result_name(result)}")
        self.module = module[0]
        bindings = ffi.new("VkDescriptorSetLayoutBinding[]", n_bindings)
        for i in range(n_bindings):
            bindings[i].binding = i
            bindings[i].descriptorType = 7  # STORAGE_BUFFER
            bindings[i].descriptorCount = 1
            bindings[i].stageFlags = 0x20  # COMPUTE
        dsl_info = ffi.new("VkDescriptorSetLayoutCreateInfo*")
        dsl_info.sType = ST["dsl"]
        dsl_info.bindingCount = n_bindings
        dsl_info.pBindings = bindings
        dsl = ffi.new("VkDescriptorSetLayout*")
        check(lib.vkCreateDescriptorSetLayout(dev, dsl_info, ffi.NULL, dsl), "vkCreateDescriptorSetLayout")
        self.set_layout = dsl[0]
        push_range = ffi.new("VkPushConstantRange*")
        push_range.stageFlags = 0x20
        push_range.offset = 0
        push_range.size = push_bytes
        layouts = ffi.new("VkDescriptorSetLayout[]", [self.set_layout])
        layout_info = ffi.new("VkPipelineLayoutCreateInfo*")
        layout_info.sType = ST["pipeline_layout"]
        layout_info.setLayoutCount = 1
        layout_info.pSetLayouts = layouts
        layout_info.pushConstantRangeCount = 1 if push_bytes else 0
        layout_info.pPushConstantRanges = push_range if push_bytes else ffi.NULL
        layout = ffi.new("VkPipelineLayout*")
        check(lib.vkCreatePipelineLayout(dev, layout_info, ffi.NULL, layout), "vkCreatePipelineLayout")
        self.layout = layout[0]
        spec_constants = spec_constants or {}
        entries = ffi.new("VkSpecializationMapEntry[]", max(len(spec_constants), 1))
        data = bytearray()
        for i, (cid, value) in enumerate(sorted(spec_constants.items())):
            entries[i].constantID = cid
            entries[i].offset = len(data)
            entries[i].size = 4
            data += struct.pack("<f" if isinstance(value, float) else "<i", value)
        spec_data = ffi.new("char[]", bytes(data) or b"\0")
        spec_info = ffi.new("VkSpecializationInfo*")
        spec_info.mapEntryCount = len(spec_constants)
        spec_info.pMapEntries = entries
        spec_info.dataSize = len(data)
        spec_info.pData = spec_data
        entry_name = ffi.new("char[]", b"main")
        info = ffi.new("VkComputePipelineCreateInfo*")
        info.sType = ST["compute_pipeline"]
        info.stage.sType = ST["stage"]
        info.stage.stage = 0x20
        info.stage.module = self.module
        info.stage.pName = entry_name
        info.stage.pSpecializationInfo = spec_info
        self.subgroup_size = None  # the size this pipeline requires, where it requires one
        size_range = device.info.subgroup_size_range
        if subgroup_size is not None and size_range is not None and size_range[0] <= subgroup_size <= size_range[1]:
            required = ffi.new("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo*")
            required.sType = ST["required_subgroup_size"]
            required.requiredSubgroupSize = subgroup_size
            info.stage.pNext = required
            if device.info.full_subgroups:
                info.stage.flags = 0x2  # REQUIRE_FULL_SUBGROUPS
            self.subgroup_size = subgroup_size
        info.layout = self.layout
        if device.pipeline_stats:
            info.flags = 0x40  # CAPTURE_STATISTICS
        pipeline = ffi.new("VkPipeline*")
        result = lib.vkCreateComputePipelines(dev, ffi.NULL, 1, info, ffi.NULL, pipeline)
        if result != 0:
            self._destroy_layouts()
            raise CompileError(f"pipeline {name}", f"vkCreateComputePipelines failed: {_result_name(result)}")
        self.pipeline = pipeline[0]

    def statistics(self) -> dict[str, Any]:
        """The driver's compiler statistics of this pipeline's executables ({} unless the device
        was opened with ``pipeline_stats`` and the driver offers them)."""
        if not self.device.pipeline_stats:
            return {}
        dev = self.device.device
        get_props = ffi.cast("PFN_vkGetPipelineExecutablePropertiesKHR",
                             lib.vkGetDeviceProcAddr(dev, b"vkGetPipelineExecutablePropertiesKHR"))
        get_stats = ffi.cast("PFN_vkGetPipelineExecutableStatisticsKHR",
                             lib.vkGetDeviceProcAddr(dev, b"vkGetPipelineExecutableStatisticsKHR"))
        pinfo = ffi.new("VkPipelineInfoKHR*")
        pinfo.sType = ST["pipeline_info"]
        pinfo.pipeline = self.pipeline
        count = ffi.new("uint32_t*")
        check(get_props(dev, pinfo, count, ffi.NULL), "vkGetPipelineExecutablePropertiesKHR")
        props = ffi.new("VkPipelineExecutablePropertiesKHR[]", count[0])
        for i in range(count[0]):
            props[i].sType = ST["exec_props"]
        check(get_props(dev, pinfo, count, props), "vkGetPipelineExecutablePropertiesKHR")
        out: dict[str, Any] = {}
        for i in range(count[0]):
            einfo = ffi.new("VkPipelineExecutableInfoKHR*")
            einfo.sType = ST["exec_info"]
            einfo.pipeline = self.pipeline
            einfo.executableIndex = i
            n = ffi.new("uint32_t*")
            check(get_stats(dev, einfo, n, ffi.NULL), "vkGetPipelineExecutableStatisticsKHR")
            stats = ffi.new("VkPipelineExecutableStatisticKHR[]", n[0])
            for j in range(n[0]):
                stats[j].sType = ST["exec_stat"]
            check(get_stats(dev, einfo, n, stats), "vkGetPipelineExecutableStatisticsKHR")
            values = {}
            for j in range(n[0]):
                st = stats[j]
                fmt = int(st.format)  # BOOL32, INT64, UINT64, FLOAT64
                values[_cstr(st.name)] = (bool(st.value.b32), int(st.value.i64), int(st.value.u64),
                                          float(st.value.f64))[fmt]
            out[f"{_cstr(props[i].name)} (subgroup {props[i].subgroupSize})"] = values
        return out

    def _destroy_layouts(self) -> None:
        dev = self.device.device
        lib.vkDestroyPipelineLayout(dev, self.layout, ffi.NULL)
        lib.vkDestroyDescriptorSetLayout(dev, self.set_layout, ffi.NULL)
        lib.vkDestroyShaderModule(dev, self.module, ffi.NULL)

    def destroy(self) -> None:
        if self.pipeline is None or self.device.closed:
            self.pipeline = None
            return
        lib.vkDestroyPipeline(self.device.device, self.pipeline, ffi.NULL)
        self._destroy_layouts()
        self.pipeline = None


@dataclass
class Dispatch:
    """One recorded dispatch: a pipeline, its buffers in binding order, push constants, groups.

    ``barrier=False`` lets it overlap the dispatch before it (neither reads what the other
    writes); by default a full barrier orders it after everything recorded earlier.
    """

    pipeline: Pipeline
    buffers: Sequence[Buffer]
    push: bytes
    groups: tuple[int, int, int]
    barrier: bool = True


class Program:
    """A command buffer recorded once (dispatches separated by barriers where they ask) and re-submitted.

    Recorded with SIMULTANEOUS_USE so one submission may list it several times (several
    training steps); a barrier at its start orders it after anything submitted before. With
    ``timestamps`` a GPU timestamp is written before the first dispatch and after each one
    (:meth:`gpu_seconds` reads them back, for the last copy that ran).
    """

    def __init__(self, device: Device, dispatches: Sequence[Dispatch], timestamps: bool = False):
        self.device = device
        self.dispatches = list(dispatches)  # keeps the buffers referenced while recorded
        dev = device.device
        self.query_pool = None
        if timestamps:
            qinfo = ffi.new("VkQueryPoolCreateInfo*")
            qinfo.sType = ST["query_pool"]
            qinfo.queryType = 2  # TIMESTAMP
            qinfo.queryCount = len(self.dispatches) + 1
            qpool = ffi.new("VkQueryPool*")
            check(lib.vkCreateQueryPool(dev, qinfo, ffi.NULL, qpool), "vkCreateQueryPool")
            self.query_pool = qpool[0]
        sizes = ffi.new("VkDescriptorPoolSize*")
        sizes.type = 7
        sizes.descriptorCount = max(1, sum(d.pipeline.n_bindings for d in dispatches))
        pool_info = ffi.new("VkDescriptorPoolCreateInfo*")
        pool_info.sType = ST["pool"]
        pool_info.maxSets = max(1, len(dispatches))
        pool_info.poolSizeCount = 1
        pool_info.pPoolSizes = sizes
        pool = ffi.new("VkDescriptorPool*")
        check(lib.vkCreateDescriptorPool(dev, pool_info, ffi.NULL, pool), "vkCreateDescriptorPool")
        self.pool = pool[0]
        self.cb = device.allocate_command_buffer()
        begin = ffi.new("VkCommandBufferBeginInfo*")
        begin.sType = ST["cb_begin"]
        begin.flags = 0x4  # SIMULTANEOUS_USE
        check(lib.vkBeginCommandBuffer(self.cb, begin), "vkBeginCommandBuffer")
        if self.query_pool is not None:
            lib.vkCmdResetQueryPool(self.cb, self.query_pool, 0, len(self.dispatches) + 1)
        for i, d in enumerate(dispatches):
            if d.barrier or i == 0:
                full_barrier(self.cb)
            if self.query_pool is not None and i == 0:
                lib.vkCmdWriteTimestamp(self.cb, 0x2000, self.query_pool, 0)  # BOTTOM_OF_PIPE: earlier work done
            ds = self._descriptor_set(d)
            lib.vkCmdBindPipeline(self.cb, 1, d.pipeline.pipeline)  # COMPUTE bind point
            sets = ffi.new("VkDescriptorSet[]", [ds])
            lib.vkCmdBindDescriptorSets(self.cb, 1, d.pipeline.layout, 0, 1, sets, 0, ffi.NULL)
            if d.pipeline.push_bytes:
                push = ffi.from_buffer(bytearray(d.push.ljust(d.pipeline.push_bytes, b"\0")))
                lib.vkCmdPushConstants(self.cb, d.pipeline.layout, 0x20, 0, d.pipeline.push_bytes, push)
            lib.vkCmdDispatch(self.cb, *d.groups)
            if self.query_pool is not None:
                lib.vkCmdWriteTimestamp(self.cb, 0x2000, self.query_pool, i + 1)  # BOTTOM_OF_PIPE: done
        full_barrier(self.cb)
        check(lib.vkEndCommandBuffer(self.cb), "vkEndCommandBuffer")

    def _descriptor_set(self, d: Dispatch) -> Any:
        dev = self.device.device
        layouts = ffi.new("VkDescriptorSetLayout[]", [d.pipeline.set_layout])
        alloc = ffi.new("VkDescriptorSetAllocateInfo*")
        alloc.sType = ST["ds_alloc"]
        alloc.descriptorPool = self.pool
        alloc.descriptorSetCount = 1
        alloc.pSetLayouts = layouts
        out = ffi.new("VkDescriptorSet*")
        check(lib.vkAllocateDescriptorSets(dev, alloc, out), "vkAllocateDescriptorSets")
        n = d.pipeline.n_bindings
        if len(d.buffers) != n:
            raise LaunchError(f"{d.pipeline.name} takes {n} buffers; got {len(d.buffers)}")
        infos = ffi.new("VkDescriptorBufferInfo[]", n)
        writes = ffi.new("VkWriteDescriptorSet[]", n)
        for i, buf in enumerate(d.buffers):
            infos[i].buffer = buf.handle
            infos[i].offset = 0
            infos[i].range = buf.size  # the real size: VK_WHOLE_SIZE overflows in the bindings
            writes[i].sType = ST["write_ds"]
            writes[i].dstSet = out[0]
            writes[i].dstBinding = i
            writes[i].descriptorCount = 1
            writes[i].descriptorType = 7
            writes[i].pBufferInfo = infos + i
        lib.vkUpdateDescriptorSets(dev, n, writes, 0, ffi.NULL)
        return out[0]

    def run(self, times: int = 1, wait: bool = True) -> None:
        self.device.submit([self.cb] * times, wait=wait)

    def gpu_seconds(self) -> list[float]:
        """GPU time of each dispatch in the last completed run (recorded with ``timestamps``)."""
        if self.query_pool is None:
            raise LaunchError("this program was recorded without timestamps")
        n = len(self.dispatches) + 1
        data = ffi.new("uint64_t[]", n)
        check(lib.vkGetQueryPoolResults(self.device.device, self.query_pool, 0, n, 8 * n, data, 8, 0x1 | 0x2),
              "vkGetQueryPoolResults")  # 64-bit, wait
        period = self.device.info.timestamp_period_ns * 1e-9
        return [(data[i + 1] - data[i]) * period for i in range(n - 1)]

    def destroy(self) -> None:
        if self.cb is None or self.device.closed:
            self.cb = None
            self.dispatches = []
            return
        dev = self.device.device
        cbs = ffi.new("VkCommandBuffer[]", [self.cb])
        lib.vkFreeCommandBuffers(dev, self.device.command_pool, 1, cbs)
        lib.vkDestroyDescriptorPool(dev, self.pool, ffi.NULL)
        if self.query_pool is not None:
            lib.vkDestroyQueryPool(dev, self.query_pool, ffi.NULL)
            self.query_pool = None
        self.cb = None
        self.dispatches = []
