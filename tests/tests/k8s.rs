//! The Kubernetes manifests (deploy/k8s/): valid against the Kubernetes schemas (kubernetes-validate,
//! strict, installed by scripts/install-k8s-validate.sh); the DaemonSet unprivileged and RBAC-free,
//! with limits, every path the daemon writes on a mount, and probes that a real daemon started with
//! the DaemonSet's environment answers; the job pod snippet reaching the same host socket directory and
//! the plugin the init container installs; the kustomize base listing every manifest; the Service
//! and the ServiceMonitor finding the daemons' metrics port; the cluster overlay (deploy/k8s-cluster)
//! giving the daemon the node's collector and per-job series, still a valid DaemonSet; the pod
//! snippet's pod and namespace reaching the ranks' metrics and spans.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn venv(bin: &str) -> PathBuf {
    let p = repo().join(".venv-k8s/bin").join(bin);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/install-k8s-validate.sh (scripts/test.sh does)",
        p.display()
    );
    p
}

/// Every document of deploy/k8s/NAME, read by PyYAML (the validator's own parser).
fn docs(name: &str) -> Vec<Value> {
    docs_at(&repo().join("deploy/k8s").join(name))
}

fn docs_at(path: &Path) -> Vec<Value> {
    let out = Command::new(venv("python"))
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

const MANIFESTS: [&str; 4] = [
    "namespace.yaml",
    "daemonset.yaml",
    "service.yaml",
    "pod-snippet.yaml",
];

/// Validates `files` against the Kubernetes schemas, strictly.
fn validate(files: &[PathBuf]) {
    // The oldest Kubernetes still in wide use and the newest the checker knows.
    for version in ["1.29.0", "1.37.0"] {
        let out = Command::new(venv("kubernetes-validate"))
            .args(["--strict", "--no-warn", "-k", version])
            .args(files)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{version}: {text}{out:?}");
        assert_eq!(text.matches(" passed ").count(), files.len(), "{text}");
    }
}

#[test]
fn the_manifests_are_valid_kubernetes_objects() {
    validate(&MANIFESTS.map(|m| repo().join("deploy/k8s").join(m)));

    let kustomization = &docs("kustomization.yaml")[0];
    let mut listed: Vec<&str> = kustomization["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        ["daemonset.yaml", "namespace.yaml", "service.yaml"],
        "the base deploys the namespace, the DaemonSet and its Service, not the job example"
    );
    let dir: Vec<String> = std::fs::read_dir(repo().join("deploy/k8s"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    for f in &dir {
        assert!(
            MANIFESTS.contains(&f.as_str()),
            "{f} is neither validated nor listed"
        );
    }
    assert_eq!(kustomization["images"][0]["name"], "ncclscope");
}

fn daemonset() -> Value {
    docs("daemonset.yaml").remove(0)
}

fn env(container: &Value, name: &str) -> Option<String> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_string))
}

#[test]
fn the_daemonset_is_unprivileged_rbac_free_and_bounded() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false, "no API access");
    assert!(pod.get("serviceAccountName").is_none());
    // hostPID only: SO_PEERCRED reports a pid only inside a PID namespace the daemon can see.
    assert_eq!(pod["hostPID"], true);
    assert!(pod.get("hostNetwork").is_none() && pod.get("hostIPC").is_none());
    let containers: Vec<&Value> = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(pod["initContainers"].as_array().unwrap())
        .collect();
    for c in &containers {
        let sc = &c["securityContext"];
        assert!(sc.get("privileged").is_none_or(|p| p == false), "{c}");
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{c}");
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{c}");
        assert_eq!(
            sc["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{c}"
        );
        assert!(sc["capabilities"].get("add").is_none(), "{c}");
        for kind in ["requests", "limits"] {
            for r in ["cpu", "memory"] {
                assert!(c["resources"][kind][r].is_string(), "{kind}.{r}: {c}");
            }
        }
    }
}

#[test]
fn every_path_the_daemon_writes_is_mounted_and_its_probes_answer() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    let daemon = &pod["containers"][0];
    assert_eq!(
        daemon["image"].as_str().unwrap().split(':').next(),
        Some("ncclscope")
    );
    // The configuration the image carries (the package's), as the daemon loads it with the
    // DaemonSet's environment.
    let vars: Vec<(String, String)> = daemon["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect();
    let args: Vec<&str> = daemon["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        ["daemon", "--config", "/etc/ncclscope/ncclscope.toml"]
    );
    let config = ncclscope::config::Config::load(
        Some(&repo().join("deploy/ncclscope.toml")),
        vars.clone(),
        &Default::default(),
    )
    .unwrap();
    let mounts: Vec<&str> = daemon["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for path in [
        &config.socket,
        &config.api_socket,
        &config.state_dir,
        &config.spool.dir,
    ] {
        assert!(
            mounts.iter().any(|m| path.starts_with(m)),
            "{} is on the read-only root file system (mounts {mounts:?})",
            path.display()
        );
    }
    // The socket directory is the host's, where job pods find it.
    let host_path = |pod: &Value, mount: &Value| -> String {
        let vol = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        vol["hostPath"]["path"].as_str().unwrap().to_string()
    };
    let run_mount = daemon["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| config.socket.starts_with(m["mountPath"].as_str().unwrap()))
        .unwrap();
    assert_eq!(host_path(pod, run_mount), "/run/ncclscope");

    // Probes: the port they name is where the daemon listens; a real daemon with this environment
    // (on a free port instead, and temporary directories) answers the probe's request.
    let port = daemon["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .unwrap()["containerPort"]
        .as_u64()
        .unwrap();
    assert_eq!(config.prometheus.listen, format!("0.0.0.0:{port}"));
    let mut paths = Vec::new();
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &daemon[probe]["httpGet"];
        assert_eq!(get["port"], "metrics", "{probe}");
        paths.push(get["path"].as_str().unwrap().to_string());
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child =
        ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), d)
            .args(["--otlp-endpoint", ""])
            .envs(vars)
            .env("NCCLSCOPE_PROMETHEUS_LISTEN", format!("127.0.0.1:{free}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(d.join("daemon.log")).unwrap())
            .spawn()
            .unwrap();
    let get = |path: &str| -> Option<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", free)).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut r = String::new();
        s.read_to_string(&mut r).ok()?;
        Some(r)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    for path in &paths {
        let answer = loop {
            if let Some(a) = get(path) {
                break a;
            }
            assert!(
                Instant::now() < deadline && child.try_wait().unwrap().is_none(),
                "{}",
                std::fs::read_to_string(d.join("daemon.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn job_pods_reach_the_daemons_socket_and_the_plugin_it_installs() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    let job = docs("pod-snippet.yaml").remove(0);
    let job_pod = &job["spec"]["template"]["spec"];
    let trainer = &job_pod["containers"][0];
    let host_of = |pod: &Value, c: &Value, path: &str| -> (String, bool) {
        let m = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("no mount at {path}: {c}"));
        let vol = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap();
        (
            vol["hostPath"]["path"].as_str().unwrap().to_string(),
            m["readOnly"] == true,
        )
    };
    // The plugin's default socket (NCCLSCOPE_SOCKET unset) in the daemon's host directory.
    assert!(env(trainer, "NCCLSCOPE_SOCKET").is_none());
    assert_eq!(
        host_of(job_pod, trainer, "/run/ncclscope"),
        ("/run/ncclscope".to_string(), true)
    );
    assert_eq!(
        host_of(pod, &pod["containers"][0], "/run/ncclscope").0,
        "/run/ncclscope"
    );
    // NCCL_PROFILER_PLUGIN names the file the init container copies from the image (where the .deb
    // puts it) into the host directory the job pod mounts.
    let plugin = PathBuf::from(env(trainer, "NCCL_PROFILER_PLUGIN").unwrap());
    let (job_host_dir, ro) = host_of(job_pod, trainer, plugin.parent().unwrap().to_str().unwrap());
    assert!(ro);
    let init = &pod["initContainers"][0];
    let script = init["command"][2].as_str().unwrap();
    let init_mount = init["volumeMounts"][0]["mountPath"].as_str().unwrap();
    assert_eq!(host_of(pod, init, init_mount).0, job_host_dir);
    let file = plugin.file_name().unwrap().to_str().unwrap();
    assert!(
        script.contains(&format!("/usr/lib/x86_64-linux-gnu/{file} "))
            && script.ends_with(&format!(" {init_mount}/{file}")),
        "{script}"
    );
    // One job id for all of the job's pods.
    let job_name = trainer["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NCCLSCOPE_K8S_JOB_NAME")
        .unwrap();
    assert_eq!(
        job_name["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.labels['batch.kubernetes.io/job-name']"
    );
    assert!(job_pod.get("hostPID").is_none() && job_pod.get("hostIPC").is_none());
}

#[test]
fn the_service_and_the_service_monitor_find_every_daemons_metrics_port() {
    let ds = daemonset();
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    let service = docs("service.yaml").remove(0);
    assert_eq!(
        service["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    // Every selector label is on the DaemonSet's pods.
    for (k, v) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "selector {k}");
    }
    assert_eq!(
        service["spec"]["clusterIP"], "None",
        "each pod scraped, none balanced"
    );
    let port = &service["spec"]["ports"][0];
    let container_ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"].clone();
    let target = (container_ports.as_array().unwrap().iter())
        .find(|p| p["name"] == port["targetPort"])
        .unwrap_or_else(|| panic!("targetPort {} is no container port", port["targetPort"]));
    assert_eq!(port["port"], target["containerPort"]);

    let monitor = docs_at(&repo().join("deploy/k8s-cluster/servicemonitor.yaml")).remove(0);
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["kind"], "ServiceMonitor");
    assert_eq!(
        monitor["spec"]["namespaceSelector"]["matchNames"],
        serde_json::json!([service["metadata"]["namespace"]])
    );
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(&service["metadata"]["labels"][k], v, "matchLabels {k}");
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], port["name"]);
    assert_eq!(endpoint["path"], "/metrics");
    // Each target named by its node, as the shipped scrape configuration names it (host_name).
    assert_eq!(endpoint["relabelings"][0]["targetLabel"], "host_name");
    let scrape =
        std::fs::read_to_string(repo().join("deploy/prometheus/prometheus-scrape.yml")).unwrap();
    assert!(scrape.contains("target_label: host_name"), "{scrape}");
}

/// kustomize's strategic merge of a container's env list: an entry of the patch replaces the one of
/// its name, the others come first, in the patch's order (as `kubectl kustomize` renders it).
fn merge_env(base: &[Value], patch: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = (patch.iter())
        .filter(|p| !base.iter().any(|b| b["name"] == p["name"]))
        .cloned()
        .collect();
    for b in base {
        let replaced = patch.iter().find(|p| p["name"] == b["name"]);
        out.push(replaced.unwrap_or(b).clone());
    }
    out
}

/// The kubelet's `$(VAR)` expansion of an env list, with `fields` for the downward API's values.
fn expand_env(env: &[Value], fields: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = Vec::new();
    for e in env {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match e["value"].as_str() {
            Some(v) => vars
                .iter()
                .fold(v.to_string(), |v, (n, x)| v.replace(&format!("$({n})"), x)),
            None => {
                let field = e["valueFrom"]["fieldRef"]["fieldPath"].as_str().unwrap();
                let (_, v) = fields
                    .iter()
                    .find(|(f, _)| *f == field)
                    .unwrap_or_else(|| panic!("{field}"));
                v.to_string()
            }
        };
        vars.push((name, value));
    }
    vars
}

#[test]
fn the_cluster_overlay_sends_to_the_nodes_collector_and_serves_job_series() {
    let overlay = repo().join("deploy/k8s-cluster");
    let kustomization = &docs_at(&overlay.join("kustomization.yaml"))[0];
    assert_eq!(
        kustomization["resources"],
        serde_json::json!(["../k8s", "servicemonitor.yaml"])
    );
    let patch_file = kustomization["patches"][0]["path"].as_str().unwrap();
    let patch = docs_at(&overlay.join(patch_file)).remove(0);
    let mut ds = daemonset();
    assert_eq!(patch["metadata"]["name"], ds["metadata"]["name"]);
    let container = &mut ds["spec"]["template"]["spec"]["containers"][0];
    let patched = &patch["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(patched["name"], container["name"]);
    let env = merge_env(
        container["env"].as_array().unwrap(),
        patched["env"].as_array().unwrap(),
    );
    container["env"] = Value::Array(env.clone());
    // Where kubectl is installed, its kustomize renders the same list.
    if let Ok(out) = Command::new("kubectl")
        .arg("kustomize")
        .arg(&overlay)
        .output()
    {
        assert!(out.status.success(), "{out:?}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rendered.yaml"), &out.stdout).unwrap();
        let rendered = docs_at(&dir.path().join("rendered.yaml"));
        let r = rendered.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
        assert_eq!(
            r["spec"]["template"]["spec"]["containers"][0]["env"],
            Value::Array(env.clone())
        );
        assert!(rendered.iter().any(|d| d["kind"] == "ServiceMonitor"));
        assert!(rendered.iter().any(|d| d["kind"] == "Service"));
    }
    // Still a valid DaemonSet.
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("daemonset.json");
    std::fs::write(&merged, serde_json::to_vec(&ds).unwrap()).unwrap();
    validate(&[merged]);
    // The daemon it starts: the collector at the node's address, per-job series on /metrics.
    let vars = expand_env(
        &env,
        &[
            ("status.hostIP", "10.0.0.3"),
            ("spec.nodeName", "gpu-node-7"),
        ],
    );
    let config = ncclscope::config::Config::load(
        Some(&repo().join("deploy/ncclscope.toml")),
        vars,
        &Default::default(),
    )
    .unwrap();
    assert_eq!(config.otlp.endpoint, "http://10.0.0.3:4317");
    assert!(config.prometheus.job_series);
    assert_eq!(config.prometheus.listen, "0.0.0.0:9464");
    assert!(
        config
            .otlp
            .resource_attributes
            .contains("host.name=gpu-node-7"),
        "{}",
        config.otlp.resource_attributes
    );
}

/// Issue 39: a rank's metrics could not be joined to the pod that ran it. With the pod snippet's
/// variables (the downward API's values substituted), ranks of the real plugin label their per-rank
/// series with `pod` and `namespace` and their spans with `k8s.pod.name` and `k8s.namespace.name`.
#[test]
fn the_pod_snippets_pod_and_namespace_label_the_ranks_metrics_and_spans() {
    let job = docs("pod-snippet.yaml").remove(0);
    let trainer = &job["spec"]["template"]["spec"]["containers"][0];
    let pod = "nccl-training-example-0-x7k2p";
    let vars: Vec<(String, String)> = expand_env(
        trainer["env"].as_array().unwrap(),
        &[
            ("metadata.name", pod),
            ("metadata.namespace", "ml-team"),
            (
                "metadata.labels['batch.kubernetes.io/job-name']",
                "nccl-training-example",
            ),
        ],
    )
    .into_iter()
    .filter(|(k, _)| k.starts_with("NCCLSCOPE_"))
    .collect();
    assert!(
        vars.iter()
            .any(|(k, v)| k == "NCCLSCOPE_K8S_POD_NAME" && v == pod),
        "{vars:?}"
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut collector = rt
        .block_on(fake_opentelemetry_collector::FakeCollectorServer::start())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("ncclscope.toml"),
        "[prometheus]\njob_series = true\n[otlp]\nbatch_timeout_ms = 50\n",
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut daemon =
        ncclscope_tests::daemon_args(&mut Command::new(ncclscope_tests::daemon_binary()), d)
            .args(["--otlp-endpoint", &collector.endpoint()])
            .args(["--prometheus-listen", &format!("127.0.0.1:{port}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(d.join("daemon.log")).unwrap())
            .spawn()
            .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(d.join("api.sock")).is_err() {
        assert!(Instant::now() < deadline, "daemon did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ranks: Vec<_> = common::sim_ranks(&d.join("reg.sock"), "k8s-pod", 2, 1, 0)
        .iter_mut()
        .map(|c| c.envs(vars.iter().map(|(k, v)| (k, v))).spawn().unwrap())
        .collect();
    let produced: u64 = common::produced(ranks).iter().sum();
    assert!(produced > 0);

    let scrape = || ncclscope_tests::scrape_metrics(&format!("127.0.0.1:{port}"));
    let want = format!("namespace=\"ml-team\",pod=\"{pod}\"");
    let labelled = |text: &str| {
        (text.lines())
            .filter(|l| l.starts_with("ncclscope_rank_collectives_total{") && l.contains(&want))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut text = scrape();
    while labelled(&text) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        text = scrape();
    }
    assert_eq!(
        labelled(&text),
        2,
        "both ranks' series name their pod: {text}"
    );

    let spans = rt.block_on(collector.exported_spans(1, Duration::from_secs(10)));
    let rank_spans: Vec<_> = spans.iter().filter(|s| s.name.ends_with(" rank")).collect();
    assert!(!rank_spans.is_empty());
    for s in rank_spans {
        assert_eq!(ncclscope_tests::attr(s, "k8s.pod.name"), pod);
        assert_eq!(ncclscope_tests::attr(s, "k8s.namespace.name"), "ml-team");
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
}
