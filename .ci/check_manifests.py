#!/usr/bin/env python3
"""Checks of the rendered Kubernetes manifests and of the Containerfile that a schema cannot make.

Usage: check_manifests.py CONTAINERFILE NAME=RENDERED.yaml ...

Each RENDERED.yaml is `kubectl kustomize DIR` of one kustomization (NAME names it in the
messages). Checked:
- the Containerfile: a builder stage from rust >= the workspace's rust-version, building both
  binaries --release --locked; a later runtime stage that copies them to /usr/local/bin; a
  numeric non-root USER there.
- every pod: runs as non-root with a numeric uid (the Containerfile's, for the kvroute image),
  seccomp RuntimeDefault; every container: no privilege escalation, read-only root filesystem,
  all capabilities dropped, CPU and memory requests and a memory limit, liveness and readiness
  probes, an image with an explicit tag, no `$(VAR)` reference to an undefined variable.
- the router: /health for liveness, /readiness for readiness, a preStop sleep, and a
  terminationGracePeriodSeconds above the preStop sleep plus --shutdown-grace-period-secs.
  As the endpoint picker (kvroute --epp) instead of /health and /readiness: gRPC probes on
  --grpc-health-port (services inference-extension, liveness, readiness), container ports for
  --grpc-port, --grpc-health-port and --metrics-port (defaults 9002, 9003, 9090), --pool-name
  set, --pool-group the v1 group, a --pool-namespace $(VAR) that is the pod's namespace.
- every InferencePool: its selector selects pods of the render and its targetPorts are their
  ports; its endpointPickerRef is a Service of the render with that port (appProtocol http2 or
  kubernetes.io/h2c), selecting a kvroute --epp pod, whose --grpc-port the port goes to and
  whose --pool-name is this pool; every HTTPRoute's InferencePool backendRefs and Gateway
  parentRefs (and their sectionName) are objects of the render.
- every workload's selector matches its pod template; every Service and PodDisruptionBudget
  selects a pod of the same render, and a Service's named targetPorts are ports of those pods;
  where the render has kvroute-sim engines, the router's --selector matches them and their
  kvroute.io/kv-events port is one of theirs.
- every `--flag` given to kvroute or kvroute-sim, and every key of the router's config file,
  is a flag of that binary's `--help`, when the binary is built (KVROUTE_BIN_DIR, default
  target/debug); skipped with a message otherwise.
Exits 1 with every failure listed.
"""

import os
import re
import subprocess
import sys

import yaml

RUST_VERSION_FILE = "Cargo.toml"
BIN_DIR = os.environ.get("KVROUTE_BIN_DIR", "target/debug")
OUR_BINARIES = ("kvroute", "kvroute-sim")
# Our image's name in the manifests (kustomize's images: gives it its tag).
OUR_IMAGE = "kvroute"

failures = []


def fail(where, msg):
    failures.append(f"{where}: {msg}")


def workspace_rust_version():
    m = re.search(r'^rust-version\s*=\s*"([0-9.]+)"', open(RUST_VERSION_FILE).read(), re.M)
    return tuple(int(x) for x in m.group(1).split(".")) if m else (0,)


def check_containerfile(path):
    """Returns (uid, gid or None, entrypoint binary name) of the runtime stage."""
    where = path
    lines = []
    # Join continuation lines, drop comments.
    buf = ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if not buf and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            lines.append(buf.strip())
        buf = ""
    stages = []  # [(from_line, [instructions])]
    for line in lines:
        if re.match(r"(?i)^FROM\s", line):
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
    if len(stages) < 2:
        fail(where, f"wants a builder stage and a runtime stage, found {len(stages)} FROM")
        return None, None, None
    builder_from, builder = stages[0]
    m = re.match(r"(?i)^FROM\s+(?:--\S+\s+)*(\S+)\s+AS\s+(\S+)", builder_from)
    if not m:
        fail(where, f"the first stage is not named (FROM IMAGE AS builder): {builder_from}")
        return None, None, None
    image, builder_name = m.group(1), m.group(2)
    vm = re.search(r"(?:^|/)rust:(\d+)\.(\d+)(?:\.(\d+))?", image)
    if not vm:
        fail(where, f"the builder stage is not a rust:X.Y image: {image}")
    else:
        have = tuple(int(x) for x in vm.groups() if x is not None)
        want = workspace_rust_version()
        if have[: len(want)] < want[: len(have)]:
            fail(where, f"the builder's rust {image} is older than rust-version {want}")
    builds = [i for i in builder if re.match(r"(?i)^RUN\s", i) and "cargo build" in i]
    if not builds:
        fail(where, "the builder stage runs no `cargo build`")
    for need in ("--release", "--locked", "-p kvroute-gateway", "-p kvroute-sim"):
        if not any(need in b for b in builds):
            fail(where, f"`cargo build` lacks {need}")
    runtime_from, runtime = stages[-1]
    if re.search(r"(?:^|/)rust:", runtime_from):
        fail(where, f"the runtime stage is the Rust toolchain image: {runtime_from}")
    copies = " ".join(
        i for i in runtime if re.match(rf"(?i)^COPY\s+--from={re.escape(builder_name)}\s", i)
    )
    for b in OUR_BINARIES:
        if not re.search(rf"\b{re.escape(b)}(\s|$)", copies):
            fail(where, f"the runtime stage does not copy {b} from the {builder_name} stage")
    if "/usr/local/bin" not in copies:
        fail(where, "the runtime stage does not copy the binaries to /usr/local/bin")
    users = [i for i in runtime if re.match(r"(?i)^USER\s", i)]
    uid = gid = None
    if not users:
        fail(where, "the runtime stage sets no USER (it would run as root)")
    else:
        um = re.match(r"(?i)^USER\s+(\d+)(?::(\d+))?$", users[-1])
        if not um:
            fail(where, f"USER is not numeric (runAsNonRoot cannot verify a name): {users[-1]}")
        else:
            uid = int(um.group(1))
            gid = int(um.group(2)) if um.group(2) else None
            if uid == 0:
                fail(where, "USER is root")
    entry = None
    eps = [i for i in runtime if re.match(r"(?i)^ENTRYPOINT\s", i)]
    if eps:
        em = re.search(r'\[\s*"([^"]+)"', eps[-1])
        entry = os.path.basename(em.group(1)) if em else None
    return uid, gid, entry


def pod_specs(doc):
    """(pod spec, pod template labels) of a workload, or None."""
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        t = spec.get("template") or {}
        return t.get("spec") or {}, (t.get("metadata") or {}).get("labels") or {}
    if kind == "CronJob":
        t = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        return t.get("spec") or {}, (t.get("metadata") or {}).get("labels") or {}
    if kind == "Pod":
        return spec, (doc.get("metadata") or {}).get("labels") or {}
    return None


def image_repo(image):
    name = image.split("@")[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":")[0]


def image_has_tag(image):
    return "@" in image or ":" in image.rsplit("/", 1)[-1]


def binary_of(container, entrypoint):
    cmd = container.get("command")
    if cmd:
        return os.path.basename(cmd[0])
    if image_repo(container.get("image", "")) == OUR_IMAGE:
        return entrypoint
    return None


def flags_of(words):
    """Each `--flag` (without any =value) among the words."""
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def values_after(args, flag):
    """The values of a multi-valued flag: the words after it up to the next flag."""
    out, on = [], False
    for w in args:
        if w == flag:
            on = True
            continue
        if w.startswith(flag + "="):
            out.append(w.split("=", 1)[1])
            on = True
            continue
        if w.startswith("-"):
            on = False
            continue
        if on:
            out.append(w)
    return out


def single_value(args, flag):
    vals = values_after(args, flag)
    return vals[-1] if vals else None


def parse_selector(words):
    out = {}
    for w in words:
        k, _, v = w.partition("=")
        out[k] = v
    return out


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


help_cache = {}


def help_flags(binary):
    """The flags of `BIN_DIR/binary --help`, or None when it is not built."""
    if binary in help_cache:
        return help_cache[binary]
    path = os.path.join(BIN_DIR, binary)
    flags = None
    if os.access(path, os.X_OK):
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            fail(path, f"--help exited {out.returncode}: {out.stderr.strip()[:300]}")
            flags = set()
        else:
            flags = set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9_-]*)", out.stdout))
            if binary == "kvroute":
                flags |= peer_noop_flags()
    help_cache[binary] = flags
    return flags


def peer_noop_flags():
    """The peers' flags kvroute accepts as logged no-ops (`noop` rows of its peer flag table):
    taken before its parser, so not in its --help."""
    root = os.path.join(os.path.dirname(__file__), "..")
    table = os.path.join(root, "crates/gateway/src/config/peer_flags.tsv")
    with open(table) as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    decision = rows[0].index("decision")
    return {r[0] for r in rows[1:] if len(r) > decision and r[decision].startswith("noop")}


def check_render(name, path, uid, gid, entrypoint):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    if not docs:
        fail(name, "renders nothing")
        return
    workloads = []  # (doc, pod spec, template labels)
    configmaps = {}
    for d in docs:
        ps = pod_specs(d)
        if ps is not None:
            workloads.append((d, ps[0], ps[1]))
        if d.get("kind") == "ConfigMap":
            configmaps[d["metadata"]["name"]] = d.get("data") or {}
    if not workloads:
        fail(name, "renders no workload")
    sims = []  # (where, pod labels, annotations, container)
    routers = []  # (where, container)
    for d, spec, labels in workloads:
        wname = f"{name}: {d['kind']}/{d['metadata']['name']}"
        own = ((d.get("spec") or {}).get("selector") or {}).get("matchLabels")
        if own is not None and not matches(own, labels):
            fail(wname, f"its selector {own} does not match its pod template's labels {labels}")
        psc = spec.get("securityContext") or {}
        annotations = (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
            "annotations"
        ) or {}
        for c in spec.get("containers") or []:
            where = f"{wname} container {c.get('name')}"
            csc = c.get("securityContext") or {}

            def sc(key, csc=csc, psc=psc):
                return csc.get(key, psc.get(key))

            if sc("runAsNonRoot") is not True:
                fail(where, "runAsNonRoot is not true")
            run_uid = sc("runAsUser")
            if not isinstance(run_uid, int) or run_uid == 0:
                fail(where, f"runAsUser is not a numeric non-root uid: {run_uid!r}")
            image = c.get("image", "")
            if image_repo(image) == OUR_IMAGE and uid is not None:
                if run_uid != uid:
                    fail(where, f"runAsUser {run_uid} is not the Containerfile's USER {uid}")
                if gid is not None and sc("runAsGroup") not in (None, gid):
                    fail(where, f"runAsGroup {sc('runAsGroup')} is not the Containerfile's {gid}")
            if ((sc("seccompProfile") or {}).get("type")) != "RuntimeDefault":
                fail(where, "seccompProfile is not RuntimeDefault")
            if csc.get("allowPrivilegeEscalation") is not False:
                fail(where, "allowPrivilegeEscalation is not false")
            if csc.get("readOnlyRootFilesystem") is not True:
                fail(where, "readOnlyRootFilesystem is not true")
            if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
                fail(where, "capabilities do not drop ALL")
            res = c.get("resources") or {}
            for part, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
                if key not in (res.get(part) or {}):
                    fail(where, f"no resources.{part}.{key}")
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in c:
                    fail(where, f"no {probe}")
            if not image_has_tag(image):
                fail(where, f"image {image!r} has no tag (it would pull :latest)")
            env_names = {e["name"] for e in c.get("env") or []}
            words = list(c.get("command") or []) + list(c.get("args") or [])
            for w in words:
                for var in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", w):
                    if var not in env_names:
                        fail(where, f"{w!r} refers to $({var}), not in the container's env")
            binary = binary_of(c, entrypoint)
            if binary == "kvroute":
                routers.append((where, c, spec))
            elif binary == "kvroute-sim":
                sims.append((where, labels, annotations, c))
            if binary in OUR_BINARIES:
                check_flags(where, binary, flags_of(list(c.get("args") or [])
                                                     + list(c.get("command") or [])[1:]))
    for where, c, spec in routers:
        args = list(c.get("args") or [])
        if "--epp" in args:
            check_epp_container(where, c, args)
        else:
            lp = ((c.get("livenessProbe") or {}).get("httpGet") or {}).get("path")
            rp = ((c.get("readinessProbe") or {}).get("httpGet") or {}).get("path")
            if lp != "/health":
                fail(where, f"liveness probe is {lp!r}, not /health")
            if rp != "/readiness":
                fail(where, f"readiness probe is {rp!r}, not /readiness")
        sleep = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get(
            "seconds"
        )
        if not isinstance(sleep, int):
            fail(where, "no lifecycle.preStop.sleep")
            sleep = 0
        grace = single_value(args, "--shutdown-grace-period-secs")
        grace = int(grace) if grace is not None else 180
        tgps = spec.get("terminationGracePeriodSeconds", 30)
        if tgps <= sleep + grace:
            fail(
                where,
                f"terminationGracePeriodSeconds {tgps} is not above the preStop sleep {sleep}"
                f" + --shutdown-grace-period-secs {grace}",
            )
        check_config_file(where, c, spec, configmaps)
        selector = parse_selector(values_after(args, "--selector"))
        for swhere, labels, annotations, sc_ in sims:
            if "--service-discovery" in args and not matches(selector, labels):
                fail(swhere, f"its pods {labels} do not match the router's --selector {selector}")
            port = single_value(args, "--service-discovery-port")
            ports = {p.get("containerPort") for p in sc_.get("ports") or []}
            if port is not None and int(port) not in ports:
                fail(swhere, f"--service-discovery-port {port} is not one of its ports {ports}")
            ev = str(annotations.get("kvroute.io/kv-events", ""))
            em = re.search(r"(\d+)$", ev)
            if not em or int(em.group(1)) not in ports:
                fail(swhere, f"kvroute.io/kv-events {ev!r} is not one of its ports {ports}")
    check_inference_objects(name, docs, workloads, routers)
    for d in docs:
        kind = d.get("kind")
        dname = f"{name}: {kind}/{d['metadata']['name']}"
        if kind == "Service":
            sel = (d.get("spec") or {}).get("selector") or {}
        elif kind == "PodDisruptionBudget":
            sel = (((d.get("spec") or {}).get("selector") or {}).get("matchLabels")) or {}
        else:
            continue
        chosen = [(w, s) for w, s, labels in workloads if matches(sel, labels)]
        if not chosen:
            fail(dname, f"selects no pod of this render: {sel}")
        if kind == "Service":
            for p in d["spec"].get("ports") or []:
                tp = p.get("targetPort")
                if isinstance(tp, str):
                    for w, s in chosen:
                        names = {cp.get("name") for c in s.get("containers") or []
                                 for cp in c.get("ports") or []}
                        if tp not in names:
                            wn = w["metadata"]["name"]
                            fail(dname, f"targetPort {tp!r} is not a port of {wn}")


EPP_DEFAULT_PORTS = {"--grpc-port": 9002, "--grpc-health-port": 9003, "--metrics-port": 9090}
# The grpc.health.v1 services of GIE's and llm-d's EPP (kvroute --epp serves the same).
EPP_HEALTH_SERVICES = ("inference-extension", "liveness", "readiness")
POOL_GROUP = "inference.networking.k8s.io"


def epp_port(args, flag):
    v = single_value(args, flag)
    return int(v) if v is not None else EPP_DEFAULT_PORTS[flag]


def check_epp_container(where, c, args):
    """kvroute --epp: its ports, its gRPC probes on --grpc-health-port, its pool flags."""
    ports = {p.get("containerPort") for p in c.get("ports") or []}
    for flag in EPP_DEFAULT_PORTS:
        if epp_port(args, flag) not in ports:
            fail(where, f"{flag} {epp_port(args, flag)} is not one of its container ports {ports}")
    health = epp_port(args, "--grpc-health-port")
    for probe, wrong in (("livenessProbe", "readiness"), ("readinessProbe", None)):
        g = (c.get(probe) or {}).get("grpc")
        if not g:
            fail(where, f"{probe} is not a gRPC probe (an EPP's are, on --grpc-health-port)")
            continue
        if g.get("port") != health:
            fail(where, f"{probe} is on port {g.get('port')}, not --grpc-health-port {health}")
        if g.get("service") not in EPP_HEALTH_SERVICES or g.get("service") == wrong:
            fail(where, f"{probe}'s gRPC service is {g.get('service')!r}, not one of"
                 f" {[x for x in EPP_HEALTH_SERVICES if x != wrong]}")
    if single_value(args, "--pool-name") is None:
        fail(where, "--epp without --pool-name")
    group = single_value(args, "--pool-group")
    if group not in (None, POOL_GROUP):
        fail(where, f"--pool-group {group}: the render's InferencePools are {POOL_GROUP}")
    pns = single_value(args, "--pool-namespace")
    m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", pns or "")
    if m:
        env = {e["name"]: e for e in c.get("env") or []}
        ref = ((env.get(m.group(1)) or {}).get("valueFrom") or {}).get("fieldRef") or {}
        if ref.get("fieldPath") != "metadata.namespace":
            fail(where, f"--pool-namespace {pns}: {m.group(1)} is not the pod's namespace"
                 " (fieldRef metadata.namespace)")


def check_inference_objects(name, docs, workloads, routers):
    """The InferencePools, their EPP and the HTTPRoutes to them, against each other."""
    def named(kind):
        return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}

    pools, services, gateways = named("InferencePool"), named("Service"), named("Gateway")
    epps = [(w, c, list(c.get("args") or [])) for w, c, _ in routers
            if "--epp" in (c.get("args") or [])]
    pods = {id(w): (w, s, labels) for w, s, labels in workloads}
    for where, c, args in epps:
        pool = single_value(args, "--pool-name")
        if pool is not None and pool not in pools:
            fail(where, f"--pool-name {pool} is not an InferencePool of this render"
                 f" {sorted(pools)}")
        pns = single_value(args, "--pool-namespace")
        if pool in pools and pns and not pns.startswith("$("):
            have = pools[pool]["metadata"].get("namespace")
            if have and pns != have:
                fail(where, f"--pool-namespace {pns}, but InferencePool {pool} is in {have}")
    for pname, p in pools.items():
        where = f"{name}: InferencePool/{pname}"
        spec = p.get("spec") or {}
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        chosen = [(w, s) for w, s, labels in pods.values() if matches(sel, labels)]
        if not chosen:
            fail(where, f"its selector selects no pod of this render: {sel}")
        for tp in spec.get("targetPorts") or []:
            for w, s in chosen:
                have = {cp.get("containerPort") for ct in s.get("containers") or []
                        for cp in ct.get("ports") or []}
                if tp.get("number") not in have:
                    fail(where, f"targetPort {tp.get('number')} is not a port of"
                         f" {w['kind']}/{w['metadata']['name']} {sorted(have)}")
        ref = spec.get("endpointPickerRef") or {}
        if ref.get("group", "") != "" or ref.get("kind", "Service") != "Service":
            fail(where, f"endpointPickerRef is not a core Service: {ref}")
            continue
        svc = services.get(ref.get("name"))
        if svc is None:
            fail(where, f"endpointPickerRef names Service {ref.get('name')!r}, not in this render")
            continue
        want = (ref.get("port") or {}).get("number")
        sport = next((x for x in svc["spec"].get("ports") or [] if x.get("port") == want), None)
        if sport is None:
            fail(where, f"Service {ref.get('name')} has no port {want} (endpointPickerRef.port)")
            continue
        if sport.get("appProtocol") not in ("http2", "kubernetes.io/h2c"):
            fail(where, f"Service {ref.get('name')} port {want}: appProtocol"
                 f" {sport.get('appProtocol')!r}, not http2 or kubernetes.io/h2c"
                 " (ext_proc is gRPC)")
        ssel = svc["spec"].get("selector") or {}
        served = False
        for where_c, c, args in epps:
            wl = next((w for w, s, labels in pods.values()
                       if matches(ssel, labels) and c in (s.get("containers") or [])), None)
            if wl is None:
                continue
            tp = sport.get("targetPort", want)
            if isinstance(tp, str):
                tp = next((cp.get("containerPort") for cp in c.get("ports") or []
                           if cp.get("name") == tp), None)
            if tp != epp_port(args, "--grpc-port"):
                fail(where, f"Service {ref.get('name')} port {want} goes to container port {tp},"
                     f" not the EPP's --grpc-port {epp_port(args, '--grpc-port')}")
            if single_value(args, "--pool-name") != pname:
                fail(where, f"its EPP ({where_c}) picks for --pool-name"
                     f" {single_value(args, '--pool-name')}, not this pool")
            served = True
        if not served:
            fail(where, f"Service {ref.get('name')} (endpointPickerRef) selects no"
                 " kvroute --epp pod")
    for r in (d for d in docs if d.get("kind") == "HTTPRoute"):
        where = f"{name}: HTTPRoute/{r['metadata']['name']}"
        ns = r["metadata"].get("namespace")
        for rule in (r.get("spec") or {}).get("rules") or []:
            for b in rule.get("backendRefs") or []:
                if b.get("kind") == "InferencePool" and b.get("namespace", ns) == ns \
                        and b.get("name") not in pools:
                    fail(where, f"backendRef InferencePool {b.get('name')!r} is not in this render")
        for pr in (r.get("spec") or {}).get("parentRefs") or []:
            if pr.get("kind", "Gateway") != "Gateway" or pr.get("namespace", ns) != ns:
                continue
            gw = gateways.get(pr.get("name"))
            if gw is None:
                fail(where, f"parentRef Gateway {pr.get('name')!r} is not in this render")
                continue
            listeners = {x.get("name") for x in (gw.get("spec") or {}).get("listeners") or []}
            if pr.get("sectionName") and pr["sectionName"] not in listeners:
                fail(where, f"parentRef sectionName {pr['sectionName']!r} is not a listener of"
                     f" Gateway {pr.get('name')} {sorted(listeners)}")


def check_config_file(where, c, spec, configmaps):
    """The keys of the router's --config file, when it is a mounted ConfigMap of the render."""
    path = single_value(list(c.get("args") or []), "--config")
    if path is None:
        return
    for m in c.get("volumeMounts") or []:
        mp = m["mountPath"].rstrip("/")
        if not path.startswith(mp + "/"):
            continue
        key = path[len(mp) + 1:]
        vol = next((v for v in spec.get("volumes") or [] if v["name"] == m["name"]), None)
        cm = (vol or {}).get("configMap")
        if not cm or cm.get("name") not in configmaps:
            fail(where, f"--config {path} is not in a ConfigMap of this render")
            return
        text = configmaps[cm["name"]].get(key)
        if text is None:
            fail(where, f"ConfigMap {cm['name']} has no key {key!r} (--config {path})")
            return
        conf = yaml.safe_load(text) or {}
        if not isinstance(conf, dict):
            fail(where, f"{key} in ConfigMap {cm['name']} is not a mapping")
            return
        keys = ["--" + k.replace("_", "-") for k in conf if k not in ("workers", "policy_classes")]
        check_flags(f"{where} config file {key}", "kvroute", keys)
        return
    fail(where, f"--config {path} is not under a volume mount")


skipped = set()


def check_flags(where, binary, flags):
    known = help_flags(binary)
    if known is None:
        skipped.add(binary)
        return
    for f in flags:
        if f not in known:
            fail(where, f"{f} is not a flag of {binary} (per {BIN_DIR}/{binary} --help)")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    uid, gid, entrypoint = check_containerfile(sys.argv[1])
    for spec in sys.argv[2:]:
        name, _, path = spec.partition("=")
        check_render(name, path, uid, gid, entrypoint)
    for b in sorted(skipped):
        print(f"skipped: the --flag check of {b} ({BIN_DIR}/{b} is not built)")
    checked = sorted(b for b, f in help_cache.items() if f is not None)
    if checked:
        print(f"checked the flags against --help of: {', '.join(checked)}")
    for f in failures:
        print(f"FAIL {f}")
    if failures:
        sys.exit(1)
    print(f"manifest checks passed ({len(sys.argv) - 2} renders and {sys.argv[1]})")


if __name__ == "__main__":
    main()
