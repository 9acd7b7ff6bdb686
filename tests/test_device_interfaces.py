"""The CPU stand-ins of the device libraries (tests/fake_kernels.py), through which the tests run the NPU
and FlashInfer attention backends and the NPU's int8 products, held to what the real libraries declare:
torch-npu's operator schemas (op-plugin's YAML, the ATB header) and its graph API at the release the NPU
image installs (deploy/requirements-npu.txt), and FlashInfer's wrappers at the release the CUDA backend
is written from (scripts/real_models.py fetches those files of their wheels).

A stand-in takes what the real function takes, by the same names at the same positions, and makes
optional only what is optional there; so a call the backends make through it is one the real library
takes, and a bump of either pin that renames, moves or drops a parameter the backends pass fails here.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scripts import real_models
from tests import fake_kernels

pytestmark = pytest.mark.fetched


@dataclass(frozen=True)
class Param:
    name: str
    positional: bool  # may be passed by position
    optional: bool


@dataclass
class Interface:
    """A real function's parameters; `keywords`: the documented names its **kwargs take."""

    params: list[Param]
    keywords: set[str] = field(default_factory=set)


def differences(stand_in: Callable[..., Any], real: Interface) -> list[str]:
    """Where `stand_in`'s signature departs from `real`'s (empty where it conforms)."""
    signature = inspect.signature(stand_in)
    by_name = {p.name: p for p in real.params}
    positional = [p.name for p in real.params if p.positional]
    found = []
    for index, (name, param) in enumerate(signature.parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            found.append(f"{name}: a stand-in names each argument it takes")
            continue
        if name in real.keywords and name not in by_name:
            if param.kind is not param.KEYWORD_ONLY:
                found.append(f"{name}: positional here, one of the real one's keyword arguments")
            continue
        if name not in by_name:
            found.append(f"{name}: not a parameter of the real one")
            continue
        if param.kind is not param.KEYWORD_ONLY and positional[index : index + 1] != [name]:
            found.append(f"{name}: argument {index} here, not there")
        if param.default is not param.empty and not by_name[name].optional:
            found.append(f"{name}: optional here, required there")
    found += [
        f"{p.name}: required there, not taken here"
        for p in real.params
        if not p.optional and p.name not in signature.parameters
    ]
    return found


def _split(arguments: str) -> list[str]:
    """A schema's arguments at their top-level commas (types and defaults hold brackets)."""
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(arguments):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(arguments[start:i])
            start = i + 1
    return [p.strip() for p in [*pieces, arguments[start:]] if p.strip()]


def schema(functions: str, name: str) -> Interface:
    """The operator `name` (an overload as `op.out`) in op-plugin's native-functions YAML. Its first
    argument `self` is `input` in Python, as torch binds it."""
    match = re.search(rf"func: {re.escape(name)}\((.*)\) -> ", functions)
    assert match, f"torch-npu declares no {name}"
    params, keyword_only = [], False
    for argument in _split(match.group(1)):
        if argument == "*":
            keyword_only = True
            continue
        declared, _, default = argument.partition("=")
        argument_name = declared.split()[-1]
        params.append(Param("input" if argument_name == "self" else argument_name, not keyword_only, bool(default)))
    return Interface(params)


def header_function(header: str, name: str) -> Interface:
    """A C++ function of the ATB header, all of its arguments positional and required."""
    match = re.search(rf"TORCH_NPU_API [\w:<>&, ]+? {re.escape(name)}\(([^)]*)\);", header)
    assert match, f"the ATB header declares no {name}"
    return Interface([Param(re.findall(r"\w+", piece)[-1], True, False) for piece in match.group(1).split(",")])


def python_function(source: str, *path: str) -> Interface:
    """A function (`name`) or method (`Class`, `name`) of Python source, its implementation where
    typing overloads come first; **kwargs stand for the names its docstring documents."""
    scope: list[ast.stmt] = ast.parse(source).body
    found: ast.FunctionDef | ast.ClassDef | None = None
    for name in path:
        defined = [n for n in scope if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name]
        assert defined, f"no {'.'.join(path)}"
        found = defined[-1]
        scope = found.body
    assert isinstance(found, ast.FunctionDef)
    arguments = found.args
    ordered = [*arguments.posonlyargs, *arguments.args][1 if len(path) > 1 else 0 :]  # less self
    first_optional = len(ordered) - len(arguments.defaults)
    params = [Param(a.arg, True, i >= first_optional) for i, a in enumerate(ordered)]
    params += [
        Param(a.arg, False, default is not None)
        for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    keywords = set()
    if arguments.kwarg is not None:
        keywords = set(re.findall(r"^(\w+) : ", ast.get_docstring(found) or "", re.MULTILINE))
    return Interface(params, keywords)


@pytest.fixture(scope="module")
def torch_npu_files() -> Path:
    return real_models.torch_npu_interfaces() / "torch_npu"


@pytest.fixture(scope="module")
def operators(torch_npu_files: Path) -> str:
    return (torch_npu_files / "csrc/aten/npu_native_functions_by_codegen.yaml").read_text()


@pytest.fixture(scope="module")
def stand_in() -> Any:
    return fake_kernels.torch_npu()


def test_the_checker_finds_what_departs(operators: str) -> None:
    def moved(x1, scale, x2): ...  # type: ignore[no-untyped-def]

    def renamed(x1, x2, scales, *, bias=None): ...  # type: ignore[no-untyped-def]

    def optional(x1, x2, scale=None): ...  # type: ignore[no-untyped-def]

    def short(x1, x2): ...  # type: ignore[no-untyped-def]

    def loose(x1, x2, scale, **options): ...  # type: ignore[no-untyped-def]

    real = schema(operators, "npu_quant_matmul")
    assert differences(moved, real) == ["scale: argument 1 here, not there", "x2: argument 2 here, not there"]
    assert differences(renamed, real) == [
        "scales: not a parameter of the real one",
        "scale: required there, not taken here",
    ]
    assert differences(optional, real) == ["scale: optional here, required there"]
    assert differences(short, real) == ["scale: required there, not taken here"]
    assert differences(loose, real) == ["options: a stand-in names each argument it takes"]


@pytest.mark.parametrize(
    "name",
    [
        "npu_scatter_pa_kv_cache",
        "npu_dynamic_quant",
        "npu_quantize",
        "npu_trans_quant_param",
        "npu_quant_matmul",
        "npu_weight_quant_batchmatmul",
    ],
)
def test_the_npu_operators_take_what_torch_npu_declares(operators: str, stand_in: Any, name: str) -> None:
    assert differences(getattr(stand_in, name), schema(operators, name)) == []


def test_the_fused_attention_takes_what_torch_npu_declares(operators: str, stand_in: Any) -> None:
    real = schema(operators, "npu_fused_infer_attention_score")
    assert differences(stand_in.npu_fused_infer_attention_score, real) == []
    # The workspace query takes the operator's arguments.
    workspace = schema(operators, "_npu_fused_infer_attention_score_get_max_workspace")
    assert workspace == real
    assert differences(stand_in._npu_fused_infer_attention_score_get_max_workspace, workspace) == []
    # The `.out` form: the operator's arguments, a workspace, then its two outputs, which Python takes
    # as out=[attention_out, softmax_lse] (what the stand-in's `.out` takes).
    out = schema(operators, "npu_fused_infer_attention_score.out").params
    assert out == [*real.params, Param("workspace", False, True), *out[-2:]]
    assert [p.name for p in out[-2:]] == ["attention_out", "softmax_lse"]
    taken = inspect.signature(stand_in.npu_fused_infer_attention_score.out).parameters
    assert [name for name, p in taken.items() if p.kind is p.KEYWORD_ONLY] == ["workspace", "out"]


def test_the_atb_cache_writer_takes_what_its_header_declares(torch_npu_files: Path, stand_in: Any) -> None:
    header = (torch_npu_files / "include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h").read_text()
    real = header_function(header, "_npu_reshape_and_cache")
    assert differences(stand_in._npu_reshape_and_cache, real) == []


def test_the_graph_api_is_torch_npus(torch_npu_files: Path) -> None:
    npu = fake_kernels.NpuGraphs()
    exported = python_all(torch_npu_files / "npu/__init__.py")
    graphs = (torch_npu_files / "npu/graphs.py").read_text()
    utils = (torch_npu_files / "npu/utils.py").read_text()
    streams = (torch_npu_files / "npu/streams.py").read_text()
    functions = {
        "graph_task_group_begin": graphs,
        "graph_task_group_end": graphs,
        "graph_task_update_begin": graphs,
        "graph_task_update_end": graphs,
        "is_current_stream_capturing": graphs,
        "current_stream": utils,
        "stream": utils,
    }
    for name, source in functions.items():
        assert name in exported
        assert differences(getattr(npu, name), python_function(source, name)) == [], name
    assert {"ExternalEvent", "Stream"} <= exported
    for method in ("wait", "reset", "record"):
        real = python_function(streams, "ExternalEvent", method)
        assert differences(getattr(npu.ExternalEvent(), method), real) == [], method
    assert differences(npu.ExternalEvent, python_function(streams, "ExternalEvent", "__new__")) == []
    assert differences(npu.Stream, python_function(streams, "Stream", "__new__")) == []
    assert differences(npu.Stream().synchronize, python_function(streams, "Stream", "synchronize")) == []


def test_the_graph_capture_is_torch_npus(torch_npu_files: Path) -> None:
    # What models/compile.py's device_recorder calls of torch.npu (torch_npu.npu), as it calls it.
    def graph(npu_graph, *, pool): ...  # type: ignore[no-untyped-def]

    def graph_pool_handle(): ...  # type: ignore[no-untyped-def]

    def replay(): ...  # type: ignore[no-untyped-def]

    graphs = (torch_npu_files / "npu/graphs.py").read_text()
    exported = python_all(torch_npu_files / "npu/__init__.py")
    assert {"NPUGraph", "graph", "graph_pool_handle"} <= exported
    # What the pool's sizing, the device's set-up and the host copies call as torch.<device type>.
    assert {"mem_get_info", "set_device", "empty_cache", "synchronize", "is_available"} <= exported
    assert differences(graph, python_function(graphs, "graph", "__init__")) == []
    assert differences(graph_pool_handle, python_function(graphs, "graph_pool_handle")) == []
    assert differences(lambda: None, python_function(graphs, "NPUGraph", "__init__")) == []
    assert differences(replay, python_function(graphs, "NPUGraph", "replay")) == []


def python_all(path: Path) -> set[str]:
    """The names a module's `__all__` lists."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


@pytest.mark.parametrize(
    ("wrapper", "source"),
    [("BatchPrefillWithPagedKVCacheWrapper", "prefill.py"), ("BatchDecodeWithPagedKVCacheWrapper", "decode.py")],
)
def test_the_flashinfer_wrappers_take_what_flashinfer_declares(wrapper: str, source: str) -> None:
    code = (real_models.flashinfer_interfaces() / "flashinfer" / source).read_text()
    stand_in = getattr(fake_kernels.flashinfer(), wrapper)
    for method in ("__init__", "plan", "run"):
        bound = functools.partial(getattr(stand_in, method), None)  # less self
        assert differences(bound, python_function(code, wrapper, method)) == [], method
