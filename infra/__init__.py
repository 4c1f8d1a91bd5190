"""The stack as data, read in pipeline order; each package imports only the ones above it here.

    catalog/    facts with a source: GPU instance types, image references, pinned versions,
                the throughput and serving estimate tables (YAML beside the modules that load them)
    spec/       the stack file: its typed schema, loading with errors that name file and key,
                warnings, model sources, the deploying identity against the stack's admins
    plan/       decisions derived from a spec: capacity plan, vLLM memory, cold start, ingress,
                cost and showback, the model cache's bucket layout, Redis ACL users
    render/     Kubernetes manifests of a planned stack (pure)
    aws/        the Pulumi AWS program (`__main__.py` is its entry, named by Pulumi.yaml)

`pyproject.toml` ([tool.importlinter]) checks the order.
"""
