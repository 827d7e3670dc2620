"""mypy plugin: ``Settings(...)``, ``Settings.replace(...)`` and ``load_settings(...)`` take one
keyword per declared setting, typed as its field, so a misspelt keyword or a wrong type fails the
checker while the fields in ``common/config_sections.py`` stay the one declaration.

The flat names come from the declarations themselves (:data:`common.config.FIELDS`); each
keyword's type is its field's as mypy read it. ``load_settings``' overrides may also be None
(an unset CLI option).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from mypy.nodes import ARG_NAMED_OPT, ARG_STAR2, TypeInfo, Var
from mypy.plugin import FunctionSigContext, MethodSigContext, Plugin
from mypy.types import AnyType, CallableType, Instance, NoneType, Type, TypeOfAny, UnionType

sys.path.append(str(Path(__file__).resolve().parents[1]))   # mypy checks sys.path[0] after
from common.config import FIELDS, SECTIONS  # noqa: E402

SETTINGS = "common.config.Settings"
LOAD = "common.config.load_settings"


def _keywords(lookup: Callable[[str], TypeInfo], nullable: bool,
              sections: bool) -> list[tuple[str, Type]]:
    """(keyword, type) for every section (when taken) and declared setting."""
    found: list[tuple[str, Type]] = []
    infos = {name: lookup(f"{cls.__module__}.{cls.__qualname__}")
             for name, cls in SECTIONS.items()}
    if sections:
        found += [(name, _instance(info)) for name, info in infos.items()]
    for flat, (section, field) in FIELDS.items():
        node = infos[section].names[field.name].node
        kind: Type = (node.type if isinstance(node, Var) and node.type is not None
                      else AnyType(TypeOfAny.special_form))
        found.append((flat, UnionType([kind, NoneType()]) if nullable else kind))
    return found


def _instance(info: TypeInfo) -> Type:
    return Instance(info, [])


def _typed(signature: CallableType, keywords: list[tuple[str, Type]]) -> CallableType:
    """``signature`` with its ``**kwargs`` replaced by the named keywords."""
    at = signature.arg_kinds.index(ARG_STAR2)
    return signature.copy_modified(
        arg_types=signature.arg_types[:at] + [kind for _, kind in keywords],
        arg_kinds=signature.arg_kinds[:at] + [ARG_NAMED_OPT] * len(keywords),
        arg_names=signature.arg_names[:at] + [name for name, _ in keywords])


class SettingsPlugin(Plugin):
    """Types the settings' keywords from their declarations."""

    def get_function_signature_hook(
            self, fullname: str) -> Callable[[FunctionSigContext], CallableType] | None:
        if fullname == SETTINGS:
            return lambda ctx: self._sig(ctx.default_signature, ctx, False, True)
        if fullname == LOAD:
            return lambda ctx: self._sig(ctx.default_signature, ctx, True, False)
        return None

    def get_method_signature_hook(
            self, fullname: str) -> Callable[[MethodSigContext], CallableType] | None:
        if fullname == f"{SETTINGS}.replace":
            return lambda ctx: self._sig(ctx.default_signature, ctx, False, True)
        return None

    def _sig(self, signature: CallableType, ctx: FunctionSigContext | MethodSigContext,
             nullable: bool, sections: bool) -> CallableType:
        if ARG_STAR2 not in signature.arg_kinds:
            return signature
        modules = ctx.api.modules   # type: ignore[attr-defined]  # the TypeChecker's, by name

        def lookup(fullname: str) -> TypeInfo:
            module, _, name = fullname.rpartition(".")
            node = modules[module].names[name].node
            assert isinstance(node, TypeInfo), fullname
            return node

        return _typed(signature, _keywords(lookup, nullable, sections))


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return SettingsPlugin
