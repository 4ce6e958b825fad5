"""The Kubernetes manifests of deploy/kubernetes/ (issue 19), checked without a cluster.

No Kubernetes cluster runs on these machines (no k3s, kind or minikube in the package
registries), so this test is all that checks docs/deploy-kubernetes.md's manifests:

- every document loads into the model class of the official ``kubernetes`` client that
  its apiVersion and kind name (the mapping ``kubernetes.utils.create_from_yaml`` uses),
  and every key of every mapping in it is a field of that model, recursively: the
  client's deserializer drops unknown keys silently, so a typo would pass it;
- what makes the deployment work: two control-plane replicas on PostgreSQL, commands
  that name real ``space`` subcommands with options those accept (parsed by click, as
  the container will), probes on a route the control plane serves, every Secret and
  ConfigMap key referenced defined, images pinned, selectors that select;
- deploy/Dockerfile installs what scripts/setup.sh installs.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import kubernetes.client
import pytest
import yaml

from space.cli import main
from space.control.app import create_app
from space.control.nodes import NodeRegistry
from space.control.settings import ControlSettings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = MANIFESTS / "kustomization.yaml"
SECRETS = MANIFESTS / "secrets.yaml"
DOC = ROOT / "docs" / "deploy-kubernetes.md"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SETUP = ROOT / "scripts" / "setup.sh"
#: setup.sh's packages the image leaves out: the database runs in a pod of its own, and
#: Jupyter is for a test of the code interpreter template's server on the host.
NOT_IN_IMAGE = {"postgresql", "python3-ipykernel", "python3-jupyter-client", "python3-matplotlib"}
#: The uid of the image's `space` user (deploy/Dockerfile).
SPACE_UID = 10001
PLACEHOLDER = "REPLACE-ME"

Doc = dict[str, Any]


# -- loading --------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """Every YAML file under deploy/kubernetes/ but the kustomization."""
    files = sorted({*MANIFESTS.rglob("*.yaml"), *MANIFESTS.rglob("*.yml")})
    return [path for path in files if path != KUSTOMIZATION]


def documents(path: Path) -> list[Doc]:
    """The non-empty YAML documents of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_documents() -> list[Doc]:
    return [doc for path in manifest_files() for doc in documents(path)]


def the(kind: str, name: str) -> Doc:
    """The one document of ``kind`` named ``name``."""
    (found,) = [d for d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


_WORD_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def model_name(api_version: str, kind: str) -> str:
    """The client's model class for ``apiVersion``/``kind`` (``V1Deployment``), after
    checking that the API group serves that kind, as ``kubernetes.utils`` maps them:
    ``apps/v1`` is ``AppsV1Api``, which must create ``deployment`` objects. Raises
    LookupError for an unknown group, version or kind."""
    group, _, version = api_version.rpartition("/")
    group = "".join(part.capitalize() for part in group.removesuffix(".k8s.io").split("."))
    api = getattr(kubernetes.client, f"{group or 'Core'}{version.capitalize()}Api", None)
    snake = _WORD_BOUNDARY.sub("_", kind).lower()
    creates = (f"create_namespaced_{snake}", f"create_{snake}")
    if api is None or not any(hasattr(api, method) for method in creates):
        raise LookupError(f"no kind {kind!r} in apiVersion {api_version!r}")
    name = f"{version.capitalize()}{kind}"
    if not hasattr(kubernetes.client, name):
        raise LookupError(f"the client has no model {name} for {api_version}/{kind}")
    return name


_LIST = re.compile(r"^(?:List\[(.*)\]|list\[(.*)\])$")
_DICT = re.compile(r"^(?:Dict\[[^,]+, (.*)\]|dict\([^,]+, (.*)\))$")
_OPTIONAL = re.compile(r"^Optional\[(.*)\]$")


def unknown_fields(data: Any, type_name: str, where: str = "") -> list[str]:
    """Where ``data`` holds a key that the client's type ``type_name`` has no field for
    (or a mapping or list where the type has none): JSON-path-like strings, empty if
    none. Types are the client's ``openapi_types`` strings (``List[V1Container]``,
    ``Dict[str, str]``, ``V1PodSpec``); primitives and ``object`` (int-or-string) take
    any scalar."""
    if optional := _OPTIONAL.match(type_name):
        type_name = optional.group(1)
    if inner := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{where}: wants a list"]
        item = inner.group(1) or inner.group(2)
        return [
            p for i, value in enumerate(data) for p in unknown_fields(value, item, f"{where}[{i}]")
        ]
    if inner := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{where}: wants a mapping"]
        item = inner.group(1) or inner.group(2)
        return [p for k, v in data.items() for p in unknown_fields(v, item, f"{where}.{k}")]
    model = getattr(kubernetes.client, type_name, None)
    if model is None or not hasattr(model, "attribute_map"):
        if isinstance(data, dict | list) and type_name != "object":
            return [f"{where}: wants a {type_name}"]
        return []
    if not isinstance(data, dict):
        return [f"{where}: wants a {type_name} mapping"]
    fields = {key: attribute for attribute, key in model.attribute_map.items()}
    problems: list[str] = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{where}.{key}: no such field in {type_name}")
        else:
            problems += unknown_fields(value, model.openapi_types[fields[key]], f"{where}.{key}")
    return problems


@functools.cache
def _client() -> kubernetes.client.ApiClient:
    """The client whose deserializer loads documents (it never connects to anything)."""
    return kubernetes.client.ApiClient()


def load(doc: Doc) -> Any:
    """``doc`` as an instance of its model class; AssertionError naming every unknown
    field, LookupError for an unknown kind, ValueError for a missing required field."""
    name = model_name(doc.get("apiVersion", ""), doc.get("kind", ""))
    problems = unknown_fields(doc, name, doc["kind"])
    assert not problems, problems
    obj = _client().deserialize(json.dumps(doc), name, "application/json")
    assert isinstance(obj, getattr(kubernetes.client, name))
    return obj


# -- walking ---------------------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def pod_specs() -> Iterator[tuple[Doc, Doc]]:
    """(workload, its pod template's spec) of every workload."""
    for doc in all_documents():
        if doc["kind"] in WORKLOADS:
            yield doc, doc["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[Doc, Doc, Doc]]:
    """(workload, pod spec, container) of every container, init containers too."""
    for workload, spec in pod_specs():
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield workload, spec, container


def space_containers() -> list[tuple[Doc, Doc]]:
    """(workload, container) of every container running the ``space`` command."""
    return [(w, c) for w, _, c in containers() if c.get("command", [None])[0] == "space"]


def space_command(container: Doc) -> tuple[click.Command, list[str]]:
    """The click command a container runs and the arguments it gets."""
    words = [*container["command"][1:], *container.get("args", [])]
    command: click.Command = main
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        found = command.get_command(click.Context(command), words[0])
        assert found is not None, f"{container['name']}: no subcommand {words[0]!r}"
        command, words = found, words[1:]
    return command, words


def referenced(kind: str) -> Iterator[tuple[str, str | None, str]]:
    """(name, key or None, where) of every reference to a Secret or ConfigMap."""
    ref_key, volume_key = (
        ("secretKeyRef", "secret") if kind == "Secret" else ("configMapKeyRef", "configMap")
    )
    name_field = "secretName" if kind == "Secret" else "name"
    for workload, spec, container in containers():
        where = f"{workload['metadata']['name']}/{container['name']}"
        for env in container.get("env", []):
            if ref := env.get("valueFrom", {}).get(ref_key):
                yield ref["name"], ref["key"], where
        for source in container.get("envFrom", []):
            if ref := source.get(ref_key.removesuffix("KeyRef") + "Ref"):
                yield ref["name"], None, where
        for volume in spec.get("volumes", []):
            if source := volume.get(volume_key):
                yield source[name_field], None, where
                for item in source.get("items", []):
                    yield source[name_field], item["key"], where


def keys_of(doc: Doc) -> set[str]:
    return {*doc.get("data", {}), *doc.get("stringData", {}), *doc.get("binaryData", {})}


def probes(container: Doc) -> list[Doc]:
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    return [container[kind] for kind in kinds if kind in container]


# -- every manifest loads into the client's models -----------------------------------


def test_there_are_manifests_of_every_part() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in all_documents()}
    assert {
        ("Namespace", "space"),
        ("Deployment", "space-control"),
        ("Service", "space-control"),
        ("DaemonSet", "space-node"),
        ("StatefulSet", "space-postgres"),
        ("Service", "space-postgres"),
    } <= kinds


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_document_loads_into_the_client_model_of_its_kind(path: Path) -> None:
    for doc in documents(path):
        obj = load(doc)
        assert obj.metadata.name, f"{path.name}: a {doc['kind']} without a name"
        if doc["kind"] != "Namespace":
            assert obj.metadata.namespace == "space", f"{path.name}: {obj.metadata.name}"


def test_the_kustomization_names_every_manifest_but_the_placeholder_secrets() -> None:
    # `kubectl apply -k` must never overwrite the real Secrets with placeholders.
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert {MANIFESTS / name for name in listed} == set(manifest_files()) - {SECRETS}
    assert not any(d["kind"] == "Secret" for name in listed for d in documents(MANIFESTS / name))
    assert listed.index("namespace.yaml") == 0  # everything else goes into it
    images = {c["image"].rpartition(":")[0] for _, c in space_containers()}
    assert {image["name"] for image in kustomization["images"]} == images


def secrets_the_doc_creates() -> dict[str, set[str]]:
    """{name: keys} of every ``kubectl create secret`` in docs/deploy-kubernetes.md."""
    text = DOC.read_text().replace("\\\n", " ")
    made: dict[str, set[str]] = {}
    for line in text.splitlines():
        if match := re.search(r"kubectl .*create secret \S+ (\S+)(.*)", line):
            keys = re.findall(r"--from-(?:literal|file)=([\w.-]+)=", match.group(2))
            made[match.group(1)] = set(keys)
    return made


def test_the_doc_makes_every_secret_the_manifests_read_with_its_keys() -> None:
    defined = {d["metadata"]["name"]: keys_of(d) for d in documents(SECRETS)}
    assert secrets_the_doc_creates() == defined


def test_negative_a_misspelt_field_fails_at_any_depth() -> None:
    deployment = the("Deployment", "space-control")
    assert unknown_fields(deployment, "V1Deployment", "Deployment") == []
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["replica"] = misspelt["spec"].pop("replicas")
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    container["env"][0]["valueFrom"]["secretKeyRef"]["nmae"] = "x"
    assert sorted(unknown_fields(misspelt, "V1Deployment", "Deployment")) == [
        "Deployment.spec.replica: no such field in V1DeploymentSpec",
        "Deployment.spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef.nmae:"
        " no such field in V1SecretKeySelector",
        "Deployment.spec.template.spec.containers[0].readinesProbe: no such field in V1Container",
    ]
    with pytest.raises(AssertionError, match="replica"):
        load(misspelt)


def test_negative_a_mapping_where_the_model_wants_a_list_or_a_scalar_fails() -> None:
    service = the("Service", "space-control")
    wrong = json.loads(json.dumps(service))
    wrong["spec"]["ports"] = wrong["spec"]["ports"][0]
    wrong["metadata"]["name"] = {"a": 1}
    assert unknown_fields(wrong, "V1Service", "Service") == [
        "Service.metadata.name: wants a str",
        "Service.spec.ports: wants a list",
    ]


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [("apps/v1", "Deploymnet"), ("v1", "Deployment"), ("apps/v2", "Deployment"), ("", "")],
)
def test_negative_an_unknown_kind_or_a_kind_of_another_group_fails(
    api_version: str, kind: str
) -> None:
    with pytest.raises(LookupError):
        model_name(api_version, kind)


def test_the_kind_mapping_matches_the_client_for_the_kinds_used() -> None:
    assert model_name("apps/v1", "DaemonSet") == "V1DaemonSet"
    assert model_name("v1", "ConfigMap") == "V1ConfigMap"
    assert model_name("networking.k8s.io/v1", "NetworkPolicy") == "V1NetworkPolicy"
    assert model_name("policy/v1", "PodDisruptionBudget") == "V1PodDisruptionBudget"


def test_negative_a_missing_required_field_fails() -> None:
    service = json.loads(json.dumps(the("Service", "space-control")))
    del service["spec"]["ports"][0]["port"]
    with pytest.raises(ValueError, match="port"):
        load(service)


# -- what makes the deployment work ---------------------------------------------------


def test_the_control_plane_runs_two_replicas_of_space_control() -> None:
    control = the("Deployment", "space-control")
    assert control["spec"]["replicas"] == 2
    (container,) = control["spec"]["template"]["spec"]["containers"]
    command, _ = space_command(container)
    assert command.name == "control"


def test_every_space_container_names_a_real_subcommand_with_options_it_accepts() -> None:
    found = set()
    for workload, container in space_containers():
        command, args = space_command(container)
        found.add(command.name)
        where = f"{workload['metadata']['name']}/{container['name']}: space {command.name}"
        try:
            # Parsing as the container will: an unknown option, a missing value or a
            # missing required option is a UsageError.
            command.make_context(f"space {command.name}", list(args))
        except click.UsageError as exc:
            pytest.fail(f"{where} {shlex.join(args)}: {exc.format_message()}")
    assert found == {"control", "node"}
    images = {c["image"] for _, c in space_containers()}
    others = [c["name"] for _, _, c in containers() if c["image"] in images]
    assert len(others) == len(space_containers())  # the image runs nothing but `space`


def test_negative_a_misspelt_option_or_subcommand_fails_the_command_check() -> None:
    container = the("Deployment", "space-control")["spec"]["template"]["spec"]["containers"][0]
    command, args = space_command(container)
    with pytest.raises(click.NoSuchOption):
        command.make_context("space control", [*args, "--tls-crt", "x"])
    with pytest.raises(AssertionError, match="contrl"):
        space_command({**container, "command": ["space", "contrl"]})


def test_the_control_plane_is_on_postgresql_from_a_secret() -> None:
    # Without it each replica would run on SQLite in its own emptyDir: two databases.
    (container,) = the("Deployment", "space-control")["spec"]["template"]["spec"]["containers"]
    _, args = space_command(container)
    assert "--database" not in args  # a password must not show in the process list
    (env,) = [e for e in container["env"] if e["name"] == "SPACE_DATABASE_URL"]
    ref = env["valueFrom"]["secretKeyRef"]
    url = the("Secret", ref["name"])["stringData"][ref["key"]]
    assert url.startswith("postgresql://")


def test_the_control_plane_gets_its_master_key_from_the_environment() -> None:
    (container,) = the("Deployment", "space-control")["spec"]["template"]["spec"]["containers"]
    _, args = space_command(container)
    assert "--master-key-file" not in args  # a Secret volume's files are links (see there)
    assert "SPACE_MASTER_KEY" in {e["name"] for e in container["env"]}


def test_probes_of_the_control_plane_ask_a_route_it_serves_on_its_port() -> None:
    (container,) = the("Deployment", "space-control")["spec"]["template"]["spec"]["containers"]
    app = create_app(ControlSettings(data_dir=Path("/nonexistent")), NodeRegistry())
    routes = {getattr(route, "path", None) for route in app.routes}
    _, args = space_command(container)
    scheme = "HTTPS" if "--tls-cert" in args else "HTTP"
    port = args[args.index("--listen") + 1].rpartition(":")[2]
    (declared,) = container["ports"]
    assert str(declared["containerPort"]) == port
    assert len(probes(container)) == 3
    for probe in probes(container):
        get = probe["httpGet"]
        assert get["path"] in routes
        assert get["scheme"] == scheme
        assert get["port"] == declared["name"]


def test_probes_of_every_container_name_a_port_it_declares() -> None:
    for workload, _, container in containers():
        names = {p.get("name") for p in container.get("ports", [])}
        numbers = {p["containerPort"] for p in container.get("ports", [])}
        for probe in probes(container):
            action = probe.get("httpGet") or probe.get("tcpSocket")
            if action is not None:
                assert action["port"] in names | numbers, workload["metadata"]["name"]


def test_the_node_agent_listens_where_it_advertises_and_is_privileged() -> None:
    spec = the("DaemonSet", "space-node")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    command, args = space_command(container)
    assert command.name == "node"
    listen_port = args[args.index("--listen") + 1].rpartition(":")[2]
    assert args[args.index("--advertise-url") + 1].endswith(f":{listen_port}")
    assert container["ports"][0]["containerPort"] == int(listen_port)
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["runAsUser"] == 0  # it starts its root broker
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    data_dir = args[args.index("--data-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {"/dev", "/var/lib/space", "/var/cache/space"} <= host_paths
    assert "hostPath" in next(v for v in spec["volumes"] if v["name"] == mounts[data_dir])


def test_the_control_plane_runs_unprivileged_on_a_read_only_root() -> None:
    spec = the("Deployment", "space-control")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == SPACE_UID
    assert f"--uid {SPACE_UID}" in DOCKERFILE.read_text()
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "hostPath" not in json.dumps(spec)


@pytest.mark.parametrize("kind", ["Secret", "ConfigMap"])
def test_every_secret_and_config_map_referenced_exists_with_the_keys_used(kind: str) -> None:
    defined = {d["metadata"]["name"]: keys_of(d) for d in all_documents() if d["kind"] == kind}
    references = list(referenced(kind))
    assert references
    for name, key, where in references:
        assert name in defined, f"{where}: no {kind} {name!r}"
        assert key is None or key in defined[name], f"{where}: no key {key!r} in {name}"


def test_secrets_hold_placeholders_marked_to_replace_never_real_values() -> None:
    for doc in all_documents():
        if doc["kind"] == "Secret":
            assert "data" not in doc, "base64 data would hide what it holds"
            for key, value in doc["stringData"].items():
                assert PLACEHOLDER in value, f"{doc['metadata']['name']}.{key}"


def test_every_image_is_pinned_to_a_tag_other_than_latest() -> None:
    for workload, _, container in containers():
        image = container["image"]
        tag = image.rpartition("/")[2].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest"), (workload, image)


def test_selectors_select_the_pods_of_their_workload_and_services_find_pods() -> None:
    labels = []
    for workload, _ in pod_specs():
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        labels.append(pod_labels)
    for doc in all_documents():
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"].items()
            assert any(selector <= pod.items() for pod in labels), doc["metadata"]["name"]


def test_the_image_installs_every_package_setup_installs() -> None:
    setup = SETUP.read_text()
    match = re.search(r"^debian_packages=\((.*?)\)", setup, re.MULTILINE | re.DOTALL)
    assert match is not None
    packages = set(match.group(1).split())
    assert "qemu-system-x86" in packages  # the parse found the list
    dockerfile = DOCKERFILE.read_text()
    # The words of the RUN instructions that install, continuation lines included.
    runs = re.findall(r"^RUN apt-get (?:.*\\\n)*.*$", dockerfile, re.MULTILINE)
    installed = {word for run in runs for word in run.split()}
    assert packages - NOT_IN_IMAGE - installed == set()
    assert "'/src[server]'" in dockerfile
    assert re.search(r"^FROM debian:bookworm", dockerfile, re.MULTILINE)
