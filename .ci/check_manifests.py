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
    help_cache[binary] = flags
    return flags


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
