"""The fleet file's reference page (docs/config.md), generated from the config models so it cannot drift.

Every key of :class:`~fleetward.fleet.config.FleetConfig` and its sections, with its type, default,
bounds and description as the models declare them. ``python -m fleetward.fleet.configref`` prints the
page; ``--write`` rewrites docs/config.md; a test fails when the page and the models disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fleetward.fleet.config import FleetConfig

__all__ = ["render"]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"

_INTRO = """\
# Fleet file reference

<!-- Generated from fleetward/fleet/config.py by `python -m fleetward.fleet.configref --write`; a test
     fails when this page and the config models disagree. Edit the models' descriptions, not this page. -->

`fleetward up --config FILE` (and `fleetward agent|controller|router --config FILE`) read this YAML file.
Every key is optional; flags win over the file (`--workers`, `--router-port` for `routing.port`, ...).
An unknown key or a bad value is an error naming the file, the line and the field. An example with
comments: [deploy/fleet.example.yaml](../deploy/fleet.example.yaml).
"""


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is tuple:
        return f"list of {_type(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation)).replace("SecretStr", "string")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed)" if info.default_factory.__name__ == "<lambda>" else "(empty)"
    value = info.default
    if value is PydanticUndefined:
        return "(required)"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        return f"`{value}`"
    if value == ():
        return "`[]`"
    return f"`{json.dumps(value)}`"


def _bounds(info: FieldInfo) -> str:
    words = []
    for m in info.metadata:
        for cls, attr, op in ((Ge, "ge", "≥"), (Gt, "gt", ">"), (Le, "le", "≤"), (Lt, "lt", "<")):
            if isinstance(m, cls):
                words.append(f"{op} {getattr(m, attr)}")
    return ", ".join(words)


def _sections(model: type[BaseModel], prefix: str, out: list[tuple[str, type[BaseModel]]]) -> None:
    out.append((prefix, model))
    for name, info in model.model_fields.items():
        for arg in (info.annotation, *typing.get_args(info.annotation)):
            inner = typing.get_args(arg)[0] if typing.get_origin(arg) is tuple else arg
            if isinstance(inner, type) and issubclass(inner, BaseModel) and all(m is not inner for _, m in out):
                _sections(inner, f"{prefix}{name}." if prefix or name else name, out)


def render() -> str:
    """The reference page, as docs/config.md holds it."""
    sections: list[tuple[str, type[BaseModel]]] = []
    _sections(FleetConfig, "", sections)
    parts = [_INTRO]
    for prefix, model in sections:
        title = f"`{prefix.rstrip('.')}`" if prefix else "top level"
        doc = " ".join((model.__doc__ or "").split())
        parts.append(f"\n## {model.__name__}\n\n{title}: {doc}\n\n| key | type | default | bounds | meaning |\n"
                     "|---|---|---|---|---|\n")
        for name, info in model.model_fields.items():
            meaning = " ".join((info.description or "").split()).replace("|", "\\|")
            parts.append(f"| `{name}` | {_type(info.annotation)} | {_default(info)} | {_bounds(info)} | "
                         f"{meaning} |\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetward.fleet.configref", description=__doc__)
    p.add_argument("--write", action="store_true", help=f"rewrite {PAGE}")
    args = p.parse_args(argv)
    if args.write:
        PAGE.write_text(render())
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
