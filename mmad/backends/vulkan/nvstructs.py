"""Structures of ``VK_NV_cooperative_matrix2`` and ``VK_NV_cooperative_vector``, which the ``vulkan``
package's bindings (1.3.275) predate (the cooperative-vector ones only for the probe's survey).

Declared here for cffi with the fields, in order, of the Vulkan headers' ``vulkan_core.h``
(``tests/test_vulkan_nvstructs.py`` checks sizes and offsets against it); enums as the 32-bit
integers the C ABI makes of them. They are chained into the ``vulkan`` package's structures as raw
``pNext`` pointers: a cdata pointer of this FFI goes into a ``void*`` field of the other as it is.
Whoever fills one keeps the cdata alive until the Vulkan call that reads the chain returns.
"""

from __future__ import annotations

from typing import Any

import cffi

EXTENSION = "VK_NV_cooperative_matrix2"
VECTOR_EXTENSION = "VK_NV_cooperative_vector"

CDEF = """
typedef int32_t VkStructureType;
typedef uint32_t VkBool32;
typedef int32_t VkComponentTypeKHR;
typedef int32_t VkScopeKHR;
typedef int32_t VkResult;

typedef struct VkCooperativeMatrixFlexibleDimensionsPropertiesNV {
    VkStructureType       sType;
    void*                 pNext;
    uint32_t              MGranularity;
    uint32_t              NGranularity;
    uint32_t              KGranularity;
    VkComponentTypeKHR    AType;
    VkComponentTypeKHR    BType;
    VkComponentTypeKHR    CType;
    VkComponentTypeKHR    ResultType;
    VkBool32              saturatingAccumulation;
    VkScopeKHR            scope;
    uint32_t              workgroupInvocations;
} VkCooperativeMatrixFlexibleDimensionsPropertiesNV;

typedef struct VkPhysicalDeviceCooperativeMatrix2FeaturesNV {
    VkStructureType    sType;
    void*              pNext;
    VkBool32           cooperativeMatrixWorkgroupScope;
    VkBool32           cooperativeMatrixFlexibleDimensions;
    VkBool32           cooperativeMatrixReductions;
    VkBool32           cooperativeMatrixConversions;
    VkBool32           cooperativeMatrixPerElementOperations;
    VkBool32           cooperativeMatrixTensorAddressing;
    VkBool32           cooperativeMatrixBlockLoads;
} VkPhysicalDeviceCooperativeMatrix2FeaturesNV;

typedef struct VkPhysicalDeviceCooperativeMatrix2PropertiesNV {
    VkStructureType    sType;
    void*              pNext;
    uint32_t           cooperativeMatrixWorkgroupScopeMaxWorkgroupSize;
    uint32_t           cooperativeMatrixFlexibleDimensionsMaxDimension;
    uint32_t           cooperativeMatrixWorkgroupScopeReservedSharedMemory;
} VkPhysicalDeviceCooperativeMatrix2PropertiesNV;

typedef VkResult (*PFN_vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV)(
    void* physicalDevice, uint32_t* pPropertyCount, VkCooperativeMatrixFlexibleDimensionsPropertiesNV* pProperties);

typedef uint32_t VkShaderStageFlags;

typedef struct VkPhysicalDeviceCooperativeVectorPropertiesNV {
    VkStructureType       sType;
    void*                 pNext;
    VkShaderStageFlags    cooperativeVectorSupportedStages;
    VkBool32              cooperativeVectorTrainingFloat16Accumulation;
    VkBool32              cooperativeVectorTrainingFloat32Accumulation;
    uint32_t              maxCooperativeVectorComponents;
} VkPhysicalDeviceCooperativeVectorPropertiesNV;

typedef struct VkPhysicalDeviceCooperativeVectorFeaturesNV {
    VkStructureType    sType;
    void*              pNext;
    VkBool32           cooperativeVector;
    VkBool32           cooperativeVectorTraining;
} VkPhysicalDeviceCooperativeVectorFeaturesNV;

typedef struct VkCooperativeVectorPropertiesNV {
    VkStructureType       sType;
    void*                 pNext;
    VkComponentTypeKHR    inputType;
    VkComponentTypeKHR    inputInterpretation;
    VkComponentTypeKHR    matrixInterpretation;
    VkComponentTypeKHR    biasInterpretation;
    VkComponentTypeKHR    resultType;
    VkBool32              transpose;
} VkCooperativeVectorPropertiesNV;

typedef VkResult (*PFN_vkGetPhysicalDeviceCooperativeVectorPropertiesNV)(
    void* physicalDevice, uint32_t* pPropertyCount, VkCooperativeVectorPropertiesNV* pProperties);
"""

ffi = cffi.FFI()
ffi.cdef(CDEF)

# VkStructureType values (the Vulkan registry's, VK_NV_cooperative_matrix2 = extension 594)
STYPE = {
    "VkPhysicalDeviceCooperativeMatrix2FeaturesNV": 1000593000,
    "VkCooperativeMatrixFlexibleDimensionsPropertiesNV": 1000593001,
    "VkPhysicalDeviceCooperativeMatrix2PropertiesNV": 1000593002,
    "VkPhysicalDeviceCooperativeVectorFeaturesNV": 1000491000,
    "VkPhysicalDeviceCooperativeVectorPropertiesNV": 1000491001,
    "VkCooperativeVectorPropertiesNV": 1000491002,
}
# the VkBool32 members of the features structure
FEATURES = ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
            "cooperativeMatrixReductions", "cooperativeMatrixConversions",
            "cooperativeMatrixPerElementOperations", "cooperativeMatrixTensorAddressing",
            "cooperativeMatrixBlockLoads")
PROPERTIES = ("cooperativeMatrixWorkgroupScopeMaxWorkgroupSize", "cooperativeMatrixFlexibleDimensionsMaxDimension",
              "cooperativeMatrixWorkgroupScopeReservedSharedMemory")
VECTOR_FEATURES = ("cooperativeVector", "cooperativeVectorTraining")
VECTOR_PROPERTIES = ("cooperativeVectorSupportedStages", "cooperativeVectorTrainingFloat16Accumulation",
                     "cooperativeVectorTrainingFloat32Accumulation", "maxCooperativeVectorComponents")
VECTOR_FIELDS = ("inputType", "inputInterpretation", "matrixInterpretation", "biasInterpretation", "resultType",
                 "transpose")


def new(ctype: str, **fields: Any) -> Any:
    """A zeroed ``ctype`` with its sType set and ``fields`` filled."""
    struct = ffi.new(f"{ctype}*")
    struct.sType = STYPE[ctype]
    for name, value in fields.items():
        setattr(struct, name, value)
    return struct


def address(cdata: Any, other_ffi: Any) -> int:
    """The address held by a cdata pointer (or handle) of another FFI (the vulkan package's)."""
    return int(other_ffi.cast("uintptr_t", cdata))


FLEXIBLE_FIELDS = ("MGranularity", "NGranularity", "KGranularity", "AType", "BType", "CType", "ResultType",
                   "saturatingAccumulation", "scope", "workgroupInvocations")


def _property_list(command: str, ctype: str, fields: tuple[str, ...], get_proc_addr: Any, instance: Any,
                   physical: Any, vk_ffi: Any) -> list[dict[str, int]]:
    """A ``vkGetPhysicalDevice...PropertiesNV(physicalDevice, count, list)`` command's list, each
    entry's ``fields`` as integers; empty where the instance does not expose the command; a VkResult
    other than success (or VK_INCOMPLETE, whose entries are valid) raises RuntimeError."""
    ptr = get_proc_addr(instance, command.encode())
    if ptr == vk_ffi.NULL:
        return []
    fn = ffi.cast(f"PFN_{command}", address(ptr, vk_ffi))
    pd = ffi.cast("void*", address(physical, vk_ffi))
    count = ffi.new("uint32_t*")
    code = fn(pd, count, ffi.NULL)
    if code != 0:
        raise RuntimeError(f"{command} failed: VkResult {code}")
    props = ffi.new(f"{ctype}[]", count[0])
    for i in range(count[0]):
        props[i].sType = STYPE[ctype]
    code = fn(pd, count, props)
    if code not in (0, 5):
        raise RuntimeError(f"{command} failed: VkResult {code}")
    return [{name: int(getattr(props[i], name)) for name in fields} for i in range(count[0])]


def flexible_dimensions(get_proc_addr: Any, instance: Any, physical: Any, vk_ffi: Any) -> list[dict[str, int]]:
    """``vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV``'s list (FLEXIBLE_FIELDS);
    ``get_proc_addr`` is the vulkan package's ``vkGetInstanceProcAddr``."""
    return _property_list("vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV",
                          "VkCooperativeMatrixFlexibleDimensionsPropertiesNV", FLEXIBLE_FIELDS,
                          get_proc_addr, instance, physical, vk_ffi)


def vector_combinations(get_proc_addr: Any, instance: Any, physical: Any, vk_ffi: Any) -> list[dict[str, int]]:
    """``vkGetPhysicalDeviceCooperativeVectorPropertiesNV``'s list of type combinations (VECTOR_FIELDS)."""
    return _property_list("vkGetPhysicalDeviceCooperativeVectorPropertiesNV", "VkCooperativeVectorPropertiesNV",
                          VECTOR_FIELDS, get_proc_addr, instance, physical, vk_ffi)
