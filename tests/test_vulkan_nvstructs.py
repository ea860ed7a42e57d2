"""The cffi declarations of VK_NV_cooperative_matrix2's (and VK_NV_cooperative_vector's) structures
against the Vulkan headers.

The ``vulkan`` package's bindings predate these structures, so ``mmad/backends/vulkan/nvstructs.py``
declares them; a wrong field order or type would make the driver read garbage into a feature or
property. ``HEADER_LAYOUT`` is what a C compiler made of ``vulkan_core.h`` of Vulkan-Headers 1.4.359
(sizeof and offsetof of every field, x86-64 and every other LP64 or LLP64 target alike: 4-byte
enums and Bool32, 8-byte pointers); where a ``vulkan_core.h`` that declares them is at hand
(``MMAD_VULKAN_HEADERS``, ``$VULKAN_SDK/include`` or ``/usr/include``) with a C compiler, the same
figures are compiled from it too.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

nv = pytest.importorskip("mmad.backends.vulkan.nvstructs", reason="cffi is not installed")

HEADER_VERSION = 359
# struct -> [(field, offset)] in declaration order, and the size
HEADER_LAYOUT = {
    "VkPhysicalDeviceCooperativeMatrix2FeaturesNV": (48, [
        ("sType", 0), ("pNext", 8), ("cooperativeMatrixWorkgroupScope", 16),
        ("cooperativeMatrixFlexibleDimensions", 20), ("cooperativeMatrixReductions", 24),
        ("cooperativeMatrixConversions", 28), ("cooperativeMatrixPerElementOperations", 32),
        ("cooperativeMatrixTensorAddressing", 36), ("cooperativeMatrixBlockLoads", 40)]),
    "VkPhysicalDeviceCooperativeMatrix2PropertiesNV": (32, [
        ("sType", 0), ("pNext", 8), ("cooperativeMatrixWorkgroupScopeMaxWorkgroupSize", 16),
        ("cooperativeMatrixFlexibleDimensionsMaxDimension", 20),
        ("cooperativeMatrixWorkgroupScopeReservedSharedMemory", 24)]),
    "VkCooperativeMatrixFlexibleDimensionsPropertiesNV": (56, [
        ("sType", 0), ("pNext", 8), ("MGranularity", 16), ("NGranularity", 20), ("KGranularity", 24),
        ("AType", 28), ("BType", 32), ("CType", 36), ("ResultType", 40), ("saturatingAccumulation", 44),
        ("scope", 48), ("workgroupInvocations", 52)]),
    "VkPhysicalDeviceCooperativeVectorFeaturesNV": (24, [
        ("sType", 0), ("pNext", 8), ("cooperativeVector", 16), ("cooperativeVectorTraining", 20)]),
    "VkPhysicalDeviceCooperativeVectorPropertiesNV": (32, [
        ("sType", 0), ("pNext", 8), ("cooperativeVectorSupportedStages", 16),
        ("cooperativeVectorTrainingFloat16Accumulation", 20), ("cooperativeVectorTrainingFloat32Accumulation", 24),
        ("maxCooperativeVectorComponents", 28)]),
    "VkCooperativeVectorPropertiesNV": (40, [
        ("sType", 0), ("pNext", 8), ("inputType", 16), ("inputInterpretation", 20), ("matrixInterpretation", 24),
        ("biasInterpretation", 28), ("resultType", 32), ("transpose", 36)]),
}
HEADER_STYPES = {"VkPhysicalDeviceCooperativeMatrix2FeaturesNV": 1000593000,
                 "VkCooperativeMatrixFlexibleDimensionsPropertiesNV": 1000593001,
                 "VkPhysicalDeviceCooperativeMatrix2PropertiesNV": 1000593002,
                 "VkPhysicalDeviceCooperativeVectorFeaturesNV": 1000491000,
                 "VkPhysicalDeviceCooperativeVectorPropertiesNV": 1000491001,
                 "VkCooperativeVectorPropertiesNV": 1000491002}


def _layout(ctype: str) -> tuple[int, list[tuple[str, int]]]:
    return nv.ffi.sizeof(ctype), [(name, nv.ffi.offsetof(ctype, name)) for name, _ in nv.ffi.typeof(ctype).fields]


@pytest.mark.skipif(struct.calcsize("P") != 8, reason="the recorded layout is that of 64-bit targets")
@pytest.mark.parametrize("ctype", list(HEADER_LAYOUT))
def test_layout_matches_the_vulkan_headers(ctype):
    assert _layout(ctype) == HEADER_LAYOUT[ctype]
    assert nv.STYPE[ctype] == HEADER_STYPES[ctype]


def test_feature_and_property_names_are_the_structures_fields():
    features = [n for n, _ in HEADER_LAYOUT["VkPhysicalDeviceCooperativeMatrix2FeaturesNV"][1][2:]]
    properties = [n for n, _ in HEADER_LAYOUT["VkPhysicalDeviceCooperativeMatrix2PropertiesNV"][1][2:]]
    assert list(nv.FEATURES) == features and list(nv.PROPERTIES) == properties
    assert list(nv.FLEXIBLE_FIELDS) == [n for n, _ in HEADER_LAYOUT["VkCooperativeMatrixFlexibleDimensionsPropertiesNV"][1][2:]]
    fields = {name: [n for n, _ in HEADER_LAYOUT[name][1][2:]] for name in HEADER_LAYOUT}
    assert list(nv.VECTOR_FEATURES) == fields["VkPhysicalDeviceCooperativeVectorFeaturesNV"]
    assert list(nv.VECTOR_PROPERTIES) == fields["VkPhysicalDeviceCooperativeVectorPropertiesNV"]
    assert list(nv.VECTOR_FIELDS) == fields["VkCooperativeVectorPropertiesNV"]


def test_new_sets_the_structure_type_and_fields():
    s = nv.new("VkPhysicalDeviceCooperativeMatrix2FeaturesNV", cooperativeMatrixWorkgroupScope=1)
    assert s.sType == 1000593000 and s.cooperativeMatrixWorkgroupScope == 1
    assert s.cooperativeMatrixBlockLoads == 0 and s.pNext == nv.ffi.NULL


def test_chains_into_the_vulkan_packages_structures():
    """A raw pointer of this FFI in a pNext of the vulkan package's, and back, keeps its address."""
    vk = pytest.importorskip("vulkan", reason="the vulkan Python package is not installed")
    features2 = vk.ffi.new("VkPhysicalDeviceFeatures2*")
    ours = nv.new("VkPhysicalDeviceCooperativeMatrix2FeaturesNV")
    features2.pNext = ours
    assert int(vk.ffi.cast("uintptr_t", features2.pNext)) == int(nv.ffi.cast("uintptr_t", ours))
    ours.pNext = features2
    assert nv.address(features2, vk.ffi) == int(nv.ffi.cast("uintptr_t", ours.pNext))


def _headers() -> Path | None:
    candidates = [os.environ.get("MMAD_VULKAN_HEADERS", ""), os.path.join(os.environ.get("VULKAN_SDK", ""), "include"),
                  "/usr/include"]
    for folder in filter(None, candidates):
        header = Path(folder) / "vulkan" / "vulkan_core.h"
        if header.exists() and "VkPhysicalDeviceCooperativeMatrix2FeaturesNV" in header.read_text(errors="replace"):
            return Path(folder)
    return None


def test_layout_compiled_from_a_local_vulkan_core_h(tmp_path):
    folder = _headers()
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if folder is None or compiler is None:
        pytest.skip("no C compiler, or no vulkan_core.h declaring VK_NV_cooperative_matrix2 (MMAD_VULKAN_HEADERS, "
                    "$VULKAN_SDK/include, /usr/include): the recorded layout is checked above")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <vulkan/vulkan_core.h>", "int main(void) {"]
    for ctype, (_, fields) in HEADER_LAYOUT.items():
        lines.append(f'printf("{ctype} %zu\\n", sizeof({ctype}));')
        lines += [f'printf("{ctype}.{name} %zu\\n", offsetof({ctype}, {name}));' for name, _ in fields]
    lines += ["return 0; }"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([compiler, f"-I{folder}", str(src), "-o", str(exe)], check=True, capture_output=True)
    compiled = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                   check=True).stdout.splitlines())
    for ctype in HEADER_LAYOUT:
        size, fields = _layout(ctype)
        assert int(compiled[ctype]) == size, ctype
        for name, offset in fields:
            assert int(compiled[f"{ctype}.{name}"]) == offset, (ctype, name)
