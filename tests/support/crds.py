"""Validate an object against a CustomResourceDefinition the way an API server would, offline.

Three passes, in the API server's order:
1. defaults: every absent field whose schema has a `default` gets it (structural defaulting);
2. the OpenAPI v3 schema, with unknown fields forbidden where the server would prune them (a
   misspelled field fails here instead of vanishing in the cluster), by `jsonschema`;
3. the schema's CEL rules (`x-kubernetes-validations`), by `cel-python` (celpy), on each value
   present. Kubernetes' CEL adds string functions to standard CEL; the two these CRDs use,
   `split` and `find` (k8s.io/apiserver's strings and regex libraries), are provided here.
   Transition rules (those reading `oldSelf`) apply only to updates and are counted, not run.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes


def crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    assert path.is_file(), f"CRD schema expected at {path} (the shared/ folder beside the repo)"
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever the API server would prune them."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of `value` with the schema's defaults filled in where fields are absent."""
    value = copy.deepcopy(value)
    _default(schema, value)
    return value


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(value) - set(schema.get("properties", {})):
                _default(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


def _split(text: celtypes.StringType, separator: celtypes.StringType) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(part) for part in str(text).split(str(separator))])


def _find(text: celtypes.StringType, pattern: celtypes.StringType) -> celtypes.StringType:
    """k8s regex library: the first match of `pattern`, or the empty string."""
    match = re.search(str(pattern), str(text))
    return celtypes.StringType(match.group(0) if match else "")


KUBERNETES_CEL_FUNCTIONS = {"split": _split, "find": _find}


@dataclass
class CelReport:
    evaluated: list[str] = field(default_factory=list)
    """Each rule run, as `path: rule`."""
    transition_rules: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class CrdValidator:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._structural = jsonschema.Draft7Validator(strict(schema))
        self._cel = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def structural_errors(self, obj: dict[str, Any]) -> list[str]:
        defaulted = with_defaults(self.schema, obj)
        return [f"{list(e.path)}: {e.message}" for e in self._structural.iter_errors(defaulted)]

    def cel(self, obj: dict[str, Any]) -> CelReport:
        report = CelReport()
        self._walk(self.schema, with_defaults(self.schema, obj), "", report)
        return report

    def _program(self, rule: str) -> Any:
        if rule not in self._programs:
            self._programs[rule] = self._cel.program(self._cel.compile(rule), functions=KUBERNETES_CEL_FUNCTIONS)
        return self._programs[rule]

    def _walk(self, schema: dict[str, Any], value: Any, path: str, report: CelReport) -> None:
        for validation in schema.get("x-kubernetes-validations", []):
            rule = validation["rule"]
            where = f"{path or '.'}: {rule}"
            if "oldSelf" in rule:
                report.transition_rules.append(where)
                continue
            result = self._program(rule).evaluate({"self": celpy.json_to_cel(value)})
            report.evaluated.append(where)
            if not (isinstance(result, celtypes.BoolType) and bool(result)):
                report.failures.append(f"{where} -> {validation.get('message', result)}")
        if isinstance(value, dict):
            properties = schema.get("properties", {})
            for name, sub in properties.items():
                if name in value:
                    self._walk(sub, value[name], f"{path}.{name}", report)
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                for name in set(value) - set(properties):
                    self._walk(extra, value[name], f"{path}[{name}]", report)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                self._walk(schema["items"], item, f"{path}[{i}]", report)
