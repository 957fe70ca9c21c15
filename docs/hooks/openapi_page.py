"""MkDocs hook: the HTTP reference page (reference/http.md) gets the API contract,
openapi/openapi.json, rendered as Markdown at build time: every operation (by tag, in the
document's order) with its parameters, body and answers, then every schema with its
fields, types linked to their schemas. Static text: nothing is fetched when the page is
read (Swagger UI, which needs the live server, is at /docs on it).

The SDK reference (reference/sdk.md) gets the server's defaults of the tape methods'
options: the SDK sends None as "the server's default", so its signatures cannot show
them; they are read here from the same contract."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CONTRACT = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
PAGE = "reference/http.md"
SDK_PAGE = "reference/sdk.md"
# RemoteTape's methods -> the request schema whose defaults the server applies.
TAPE_METHODS = {
    "eigenvalues": "EigenvaluesRequest",
    "trace": "TraceRequest",
    "diagonal": "DiagonalRequest",
    "spectral_density": "SpectralDensityRequest",
    "solve": "SolveRequest",
    "influence": "InfluenceRequest",
}
NOT_OPTIONS = {"async", "curvature", "fisher_seed"}  # the SDK's own: progress=, curvature=
METHODS = ("get", "put", "post", "patch", "delete")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == PAGE:
        return markdown + "\n" + render(json.loads(CONTRACT.read_text()))
    if page.file.src_uri == SDK_PAGE:
        return markdown + "\n" + server_defaults(json.loads(CONTRACT.read_text()))
    return markdown


def server_defaults(contract: dict[str, Any]) -> str:
    schemas = contract["components"]["schemas"]
    out = [
        "## The server's defaults",
        "",
        (
            "What a `RemoteTape` method's option means when left at `None`: the server's "
            "default, from the contract (the HTTP reference has each option's full "
            "description)."
        ),
        "",
        "| method | request | defaults |",
        "|---|---|---|",
    ]
    for method, schema in TAPE_METHODS.items():
        properties = schemas[schema]["properties"]
        defaults = ", ".join(
            shown
            for name, spec in properties.items()
            if name not in NOT_OPTIONS and (shown := default_of(name, spec))
        )
        out.append(f"| `{method}` | [{schema}](http.md#{anchor(schema)}) | {defaults} |")
    return "\n".join(out) + "\n"


def on_config(config: Any) -> Any:
    # `mkdocs serve` rebuilds when the contract changes too.
    config.watch.append(str(CONTRACT))
    return config


def default_of(name: str, spec: dict[str, Any]) -> str:
    """`name=value` from the schema's default, or from a description's "Default: ..."
    (a default that depends on other options is written there); '' when there is none."""
    if "default" in spec:
        return f"`{name}={json.dumps(spec['default'])}`"
    described = re.search(r"Default: ([^;.]+)([;.])?", spec.get("description", ""))
    if described:
        more = " (and see its description)" if described.group(2) == ";" else ""
        return f"`{name}={described.group(1).strip()}`{more}"
    return ""


def anchor(schema: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", schema.lower()).strip("-")


def prose(text: Any) -> str:
    """A description as Markdown: brackets outside code spans escaped (`hessian[a][b]`
    written bare would read as a reference link), links `[text](url)` kept."""
    parts = str(text or "").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = re.sub(r"\[([^\]]*)\](?!\()", r"\\[\1\\]", parts[i])
    return "`".join(parts)


def cell(text: Any) -> str:
    """Text for a table cell: one line, pipes escaped."""
    return re.sub(r"\s*\n\s*", " ", prose(text)).replace("|", "\\|").strip()


def type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{anchor(name)})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            parts = [type_of(s) for s in schema[key]]
            return " or ".join(dict.fromkeys(parts))
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return "list of " + type_of(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map of " + type_of(schema["additionalProperties"])
    if kind == "string" and schema.get("format"):
        return f"string ({schema['format']})"
    return kind or "any"


def body_types(content: dict[str, Any]) -> str:
    shown = []
    for media, spec in content.items():
        schema = spec.get("schema")
        shown.append(f"`{media}`" + (f": {type_of(schema)}" if schema else ""))
    return "; ".join(shown)


def operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}` {{#{op['operationId']}}}", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**", ""]
    if op.get("description"):
        out += [prose(op["description"]), ""]
    parameters = op.get("parameters", [])
    if parameters:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in parameters:
            out.append(
                f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else ''} | {cell(p.get('description'))} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        out += [f"Body: {body_types(body.get('content', {}))}", ""]
    out += ["| status | meaning | body |", "|---|---|---|"]
    for status, answer in op.get("responses", {}).items():
        out.append(
            f"| {status} | {cell(answer.get('description'))} | "
            f"{cell(body_types(answer.get('content', {})))} |"
        )
    return [*out, ""]


def schema_section(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#{anchor(name)}}}", ""]
    if schema.get("description"):
        out += [prose(schema["description"]), ""]
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    if properties:
        out += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
        for field, spec in properties.items():
            default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
            out.append(
                f"| `{field}` | {type_of(spec)} | {'yes' if field in required else ''} | "
                f"{cell(default)} | {cell(spec.get('description'))} |"
            )
        out.append("")
    elif "type" in schema or "anyOf" in schema or "enum" in schema:
        out += [f"Type: {type_of(schema)}", ""]
    return out


def render(contract: dict[str, Any]) -> str:
    info = contract["info"]
    out = [f"Version {info['version']} of the contract (OpenAPI {contract['openapi']}).", ""]
    by_tag: dict[str, list[list[str]]] = {}
    for path, operations in contract["paths"].items():
        for method in METHODS:
            if method in operations:
                op = operations[method]
                tag = (op.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append(operation(path, method, op))
    for tag, operations in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for lines in operations:
            out += lines
    out += ["## Schemas", ""]
    for name, schema in contract["components"]["schemas"].items():
        out += schema_section(name, schema)
    return "\n".join(out)
