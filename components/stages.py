"""The stage components, typed with KFP artifacts, each made from its stage's registry entry (`evoesap.registry`).

An entry declares the component's interface: its inputs' KFP arguments and types, the grid's typed parameters, its
outputs and what it returns, each with its description. From it `component_function` writes the function's source
(kfp compiles a lightweight component from a function's source and signature) whose one line of body calls the
generic `evoesap.components.runner.run_component`; a new registry entry is a new component, nothing else to write.

A stage runs into its content-addressed URI under `storage_root` (or finds it finished there, after
checking the manifest and the payload), then fills its KFP output artifacts from it
(`evoesap.components.kfp_artifacts`): the pipeline's lineage in ML Metadata is the lineage the manifests
record. With an s3:// or gs:// root the stage reads and writes object storage itself, so the same
components run under `kfp.local` and on a cluster. Every input is documented from its declaration; `params` is
documented key by key from the stage's parameters (`evoesap.components.interface`).
"""

# No `from __future__ import annotations` here: kfp reads the real type annotations.
import dataclasses
import functools
import linecache
import os
import tempfile
import typing
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from evoesap import __version__
from evoesap import params as parameters
from evoesap.registry import STAGES, Stage

# Where the stage images are published: images/Dockerfile as `<registry>/stage:<version>`, images/Dockerfile.cuda
# as `<registry>/stage-cuda:<version>`. Fully qualified (a registry host first), so no runtime resolves a bare
# name against a default registry where anyone could have pushed it; a configuration's `registry` replaces it.
DEFAULT_REGISTRY = "ghcr.io/evoesap"


def stage_image(registry: str = DEFAULT_REGISTRY, name: str = "stage") -> str:
    """The stage image of this version in `registry`."""
    return f"{registry.rstrip('/')}/{name}:{__version__}"


def qualified(image: str) -> bool:
    """Whether `image` names its registry host (a dot or port in the first part, or localhost) and a tag or digest."""
    host, _, rest = image.partition("/")
    return bool(rest) and ("." in host or ":" in host or host == "localhost") and (":" in rest or "@" in rest)


DEFAULT_IMAGE = stage_image()

_STORAGE = (
    "Where EvoESAP keeps its content-addressed artifacts (a path, s3://, gs://); a stage whose "
    "inputs and parameters are unchanged is found finished there and reused."
)
_MODEL_IN_KFP = (
    "In KFP: a checkpoint directory (a team's Output[Model]), the output of evoesap.components.reference.model_reference"
    " naming a path, URI or hub name (`org/name@REV` at a branch, tag or commit; a cluster's importer takes "
    "object-store URIs only), or dsl.importer of an object-store URI; a hub name is identified by the commit its "
    "revision resolves to."
)
_WORKSPACE = (
    "The run's KFP workspace (dsl.WORKSPACE_PATH_PLACEHOLDER) when the model was copied there "
    "(evoesap.components.workspace): KFP mounts it into the pod, and the weights' digests are kept there. Empty: none."
)
_ARTIFACTS = {kind.__name__: kind for kind in (Artifact, Dataset, HTML, Markdown, Metrics, Model)}
_PARAMETERS = (str, float, int, bool)  # the plain types a grid parameter may take as a typed argument


def _annotation(kind: str, many: bool, required: bool, direction: str = "Input") -> str:
    """The argument's annotation in the component's source: `str`, or `Input[List[Dataset]]`, optional or not."""
    if kind == "str":
        return "str"
    if kind not in _ARTIFACTS:
        raise TypeError(f"KFP kind {kind!r} is neither str nor an artifact kind ({', '.join(_ARTIFACTS)})")
    inner = f"List[{kind}]" if many else kind
    return f"{direction}[{inner}]" if required else f"Optional[{direction}[{inner}]]"


def _grid_type(stage: Stage, name: str) -> str:
    """The plain type of a grid parameter (`criterion: str`, `sparsity: float`), from its parameter field."""
    found = parameters.kinds(typing.get_type_hints(stage.params_class())[name])
    plain = [kind for kind in _PARAMETERS if found == {kind}]
    if not plain:
        raise TypeError(f"grid parameter {stage.section}.{name} has no single plain type for KFP: {found}")
    return plain[0].__name__


class _Argument(NamedTuple):
    name: str
    annotation: str  # as the component's source writes it
    text: str  # its description
    default: str | None = None  # as the source writes it; None: required


def _arguments(stage: Stage) -> list[_Argument]:
    """The component's arguments in the order Python takes them: the required inputs, the grid, storage_root, the
    outputs, the optional inputs, params."""
    cls = stage.params_class()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required, optional = [], []
    for item in stage.inputs:
        if len(item.kfp_arguments) > 1 and not item.many:
            raise TypeError(f"{stage.name}: input {item.name!r} spreads over several KFP arguments but is not a list")
        for argument in item.kfp_arguments:
            if argument.read is not None and not item.many:
                raise TypeError(
                    f"{stage.name}: argument {argument.name!r} reads several URIs but input {item.name!r} is not a list"
                )
            text = f"{argument.help} {_MODEL_IN_KFP}" if item.model else argument.help
            if argument.required:
                required.append(_Argument(argument.name, _annotation(argument.kind, argument.many, True), text))
            elif argument.kind == "str":  # KFP's text inputs default to "", which the body reads as none
                optional.append(_Argument(argument.name, "str", f"{text} Empty: none.", '""'))
            else:
                optional.append(_Argument(argument.name, _annotation(argument.kind, argument.many, False), text, "None"))
    grid = [_Argument(name, _grid_type(stage, name), parameters.describe(cls, fields[name], hints[name])) for name in stage.grid]
    storage = [_Argument("storage_root", "str", _STORAGE)]
    outputs = [_Argument(o.name, _annotation(o.kind, False, True, "Output"), o.help) for o in stage.outputs]
    if any(item.model for item in stage.inputs):
        optional.append(_Argument("workspace", "str", _WORKSPACE, '""'))
    return [*required, *grid, *storage, *outputs, *optional, _Argument("params", "dict", "", "{}")]


def _docstring(stage: Stage, arguments: list[_Argument]) -> str:
    """The Google-style docstring kfp reads the component's descriptions from; `params` documented key by key."""
    from evoesap.components.interface import params_description

    made = {o.name for o in stage.outputs}
    args = {a.name: a.text for a in arguments if a.name not in made and a.name != "params"}
    args["params"] = params_description(stage.name, exclude=tuple(a.name for a in arguments))
    returns = {o.name: o.help for o in stage.outputs}
    if stage.returns is not None:
        returns["Output"] = stage.returns.help
    lines = [stage.summary, "", "Args:", *(f"    {k}: {v}" for k, v in args.items())]
    lines += ["", "Returns:", *(f"    {k}: {v}" for k, v in returns.items())]
    return "\n".join(lines)


def component_function(stage: Stage) -> Callable:
    """The stage's component as a Python function: its typed signature and docstring from the registry entry, its
    body the generic `run_component`. Its source is (again) registered with `linecache`, so `inspect.getsource`
    (whose text kfp embeds in the component) finds it."""
    function, source = _written(stage)
    filename = function.__code__.co_filename
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return function


@functools.cache
def _written(stage: Stage) -> tuple[Callable, str]:
    """The function's source, and the function compiled from it."""
    arguments = _arguments(stage)
    signature = ",\n".join(f"    {a.name}: {a.annotation}" + (f" = {a.default}" if a.default else "") for a in arguments)
    returns = " -> str" if stage.returns is not None else ""
    call = ", ".join(f"{a.name}={a.name}" for a in arguments)
    source = (
        f"def {stage.section}(\n{signature},\n){returns}:\n"
        f"    {stage.summary!r}\n"
        "    from evoesap.components.runner import run_component\n\n"
        f"    return run_component({stage.name!r}, {call})\n"
    )
    namespace = {"__name__": __name__, "Input": Input, "Output": Output, "List": List, "Optional": Optional, **_ARTIFACTS}
    exec(compile(source, f"<evoesap component {stage.name}>", "exec"), namespace)  # our own source, from the registry
    function = namespace[stage.section]
    function.__doc__ = _docstring(stage, arguments)
    return function, source


# The components bound to one image, as attributes named like the YAML sections (`components.cache_logits`).
StageComponents = dataclasses.make_dataclass("StageComponents", [stage.section for stage in STAGES], frozen=True)


def component(stage: Stage, image: str = DEFAULT_IMAGE) -> Callable:
    """The stage's component bound to a stage image; no packages are installed at run time."""
    return dsl.component(base_image=image, install_kfp_package=False)(component_function(stage))


def make_components(image: str = DEFAULT_IMAGE) -> StageComponents:
    """The components of every stage bound to a stage image."""
    return StageComponents(**{stage.section: component(stage, image) for stage in STAGES})


def write_component_yamls(directory: str | Path, image: str = DEFAULT_IMAGE) -> list[Path]:
    """Compile each stage component to `<directory>/<stage>.yaml`, a step any KFP pipeline can load
    (`kfp.components.load_component_from_file`)."""
    from kfp import compiler

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stage in STAGES:
        path = directory / f"{stage.section}.yaml"
        with tempfile.TemporaryDirectory(dir=directory, prefix=f".{path.name}.partial-") as tmp:
            staged = Path(tmp) / path.name
            compiler.Compiler().compile(component(stage, image), str(staged))
            os.replace(staged, path)  # a reader never sees half a component
        written.append(path)
    return written
