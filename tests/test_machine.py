"""bertopt.machine: the CPU features the runtimes' kernels use, under oneDNN's ISA cap too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bertopt.machine import cpu_features, has_int8_dot_product, has_native_bf16, isa_cap, machine_info

SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni", "sse4_2",
                   "fma"}


@pytest.mark.parametrize(("cap", "expected"), [
    ("ALL", {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni"}),
    ("AVX512_CORE_AMX", {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni"}),
    # an AVX-512 VNNI + BF16 CPU without AMX (Zen 5's kernels)
    ("AVX512_CORE_BF16", {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}),
    ("AVX512_CORE_VNNI", {"avx2", "avx512f", "avx512_vnni", "avx_vnni"}),
    ("AVX2", {"avx2"}),
    ("SSE41", set()),
])
def test_an_isa_cap_keeps_only_the_features_below_it(cap, expected):
    assert cpu_features(SAPPHIRE_RAPIDS, cap=cap) == expected


def test_a_cap_never_adds_a_feature_the_cpu_lacks():
    zen3 = {"avx2", "fma", "sse4_2"}
    assert cpu_features(zen3, cap="AVX512_CORE_BF16") == {"avx2"}
    assert not has_native_bf16(cpu_features(zen3, cap="ALL"))


def test_the_precision_questions_follow_the_cap():
    vnni_only = cpu_features(SAPPHIRE_RAPIDS, cap="AVX512_CORE_VNNI")
    assert has_int8_dot_product(vnni_only) and not has_native_bf16(vnni_only)
    avx2 = cpu_features(SAPPHIRE_RAPIDS, cap="AVX2")
    assert not has_int8_dot_product(avx2) and not has_native_bf16(avx2)


def test_the_cap_is_read_from_either_variable(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert isa_cap() is None
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx2")
    assert isa_cap() == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert isa_cap() == "AVX512_CORE_BF16"  # the newer name wins, as in oneDNN
    assert cpu_features(SAPPHIRE_RAPIDS) == cpu_features(SAPPHIRE_RAPIDS, cap="AVX512_CORE_BF16")


def test_an_unknown_cap_changes_nothing():
    # oneDNN ignores a value it does not know; so does bertopt
    assert cpu_features(SAPPHIRE_RAPIDS, cap="NOT_AN_ISA") == cpu_features(SAPPHIRE_RAPIDS, cap="ALL")


def test_machine_info_records_the_cap_and_the_capped_features():
    code = ("import json; from bertopt.machine import machine_info; i = machine_info(); "
            "print(json.dumps([i.get('isa_cap'), i.get('cpu_features')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": "/usr/bin:/bin"}).stdout
    cap, features = json.loads(out)
    assert cap == "AVX2"
    assert set(features) <= {"avx2"}


def test_machine_info_without_a_cap_names_none(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    info = machine_info()
    assert "isa_cap" not in info
    assert set(info.get("cpu_features", [])) == cpu_features(cap="ALL")
