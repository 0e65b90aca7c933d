//! The Kubernetes manifests (deploy/k8s/): valid against the Kubernetes schemas (kubernetes-validate,
//! strict, installed by scripts/install-k8s-validate.sh); the DaemonSet unprivileged and RBAC-free,
//! with limits, every path the daemon writes on a mount, and probes that a real daemon started with
//! the DaemonSet's environment answers; the job pod snippet reaching the same host socket directory and
//! the plugin the init container installs; the kustomize base listing every manifest.

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
    let out = Command::new(venv("python"))
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(repo().join("deploy/k8s").join(name))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

const MANIFESTS: [&str; 3] = ["namespace.yaml", "daemonset.yaml", "pod-snippet.yaml"];

#[test]
fn the_manifests_are_valid_kubernetes_objects() {
    // The oldest Kubernetes still in wide use and the newest the checker knows.
    for version in ["1.29.0", "1.37.0"] {
        let out = Command::new(venv("kubernetes-validate"))
            .args(["--strict", "--no-warn", "-k", version])
            .args(MANIFESTS.map(|m| repo().join("deploy/k8s").join(m)))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{version}: {text}{out:?}");
        assert_eq!(text.matches(" passed ").count(), MANIFESTS.len(), "{text}");
    }

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
        ["daemonset.yaml", "namespace.yaml"],
        "the base deploys the namespace and the DaemonSet, not the job example"
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
