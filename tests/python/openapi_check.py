"""Checks hcp-sense's OpenAPI document against the OpenAPI 3.1 schema and against the door.

Reads a plan as JSON on standard input: {"url": "http://127.0.0.1:PORT/openapi.json"}.
Validates the document with openapi-spec-validator, then asks the door, for every path it
lists, each verb it lists (unauthenticated: the door must answer the route with the API's
401, not its own 404) and each verb it does not (405). Prints one JSON report:
{"valid": true|false, "error": "...", "operations": N, "unserved": [...], "extra": [...]}.
"""
import json
import re
import sys
import urllib.error
import urllib.request

from openapi_spec_validator import validate

VERBS = ["get", "put", "post", "delete", "patch"]


def ask(base, verb, path):
    req = urllib.request.Request(base + path, method=verb.upper())
    if verb in ("post", "put", "patch"):
        req.add_header("Content-Type", "application/json")
        req.data = b"{}"
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main():
    plan = json.load(sys.stdin)
    url = plan["url"]
    base = url.rsplit("/openapi.json", 1)[0]
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.load(r)
    report = {"valid": True, "operations": 0, "unserved": [], "extra": []}
    try:
        validate(doc)
    except Exception as e:  # the validator's own error, reported whole
        report["valid"] = False
        report["error"] = str(e)[:2000]
    # A concrete path may match several templates (`/v1/ingressRoutes/{route_id}` and
    # `{route.route_id}`; `…/bindings/{principal}` holds a principal named `x:reportHealth`):
    # its verbs are theirs together.
    shapes = [(re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p)
                                  for p in re.split(r"(\{[^}]*\})", path)) + "$"), ops)
              for path, ops in doc["paths"].items()]

    def verbs(concrete):
        return {v for shape, ops in shapes if shape.match(concrete) for v in ops}

    for path, ops in doc["paths"].items():
        concrete = re.sub(r"\{[^}]*\}", "x", path)
        for verb in VERBS:
            status, body = ask(base, verb, concrete)
            if verb in ops:
                report["operations"] += 1
                # Unauthenticated: the route exists, so the API refuses it (401).
                if status != 401:
                    report["unserved"].append([verb, path, status, body.decode("utf-8", "replace")[:300]])
            elif verb not in verbs(concrete) and status != 405:
                report["extra"].append([verb, path, status])
    if report["unserved"] or report["extra"]:
        report["valid"] = False
    print(json.dumps(report))


main()
