//! The Debian package as an operator installs it (target/deb/, built by scripts/build-deb.sh, which
//! scripts/test.sh runs before the tests): exactly the files it should hold, where Debian, systemd
//! and NCCL look for them; installed by dpkg into a scratch root (maintainer scripts included) it
//! creates the system user and enables the socket and the service (once: an upgrade keeps them
//! disabled if an administrator disabled them; a reinstall after removal enables them again), whose
//! installed units pass
//! `systemd-analyze verify` and keep their hardening; the daemon in it links no test code; purging
//! it leaves nothing behind. The unit's address filter lets the collector and the Prometheus the
//! configuration names through once `ncclscope systemd-dropin` wrote its drop-in.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (dpkg, systemd and binutils are needed)"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn arch() -> String {
    run(Command::new("dpkg").arg("--print-architecture"))
        .trim()
        .to_string()
}

fn multiarch() -> &'static str {
    match arch().as_str() {
        "amd64" => "x86_64-linux-gnu",
        "arm64" => "aarch64-linux-gnu",
        a => panic!("no multiarch directory known for {a}"),
    }
}

/// target/deb/ncclscope_<version>_<arch>.deb of this workspace.
fn deb() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<test>");
    let deb = target.join("deb").join(format!(
        "ncclscope_{}_{}.deb",
        env!("CARGO_PKG_VERSION"),
        arch()
    ));
    assert!(
        deb.is_file(),
        "{} is missing: run scripts/build-deb.sh first (scripts/test.sh does)",
        deb.display()
    );
    deb
}

#[test]
fn the_package_holds_exactly_the_daemon_the_plugin_the_units_and_the_config() {
    let deb = deb();
    let listing = run(Command::new("dpkg-deb").arg("--contents").arg(&deb));
    let files: BTreeSet<(String, String)> = listing
        .lines()
        .filter(|l| l.starts_with('-'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f[1], "root/root", "{l}");
            (f[5].trim_start_matches('.').to_string(), f[0].to_string())
        })
        .collect();
    let want: BTreeSet<(String, String)> = [
        ("/usr/bin/ncclscope", "-rwxr-xr-x"),
        (
            &format!("/usr/lib/{}/libnccl-profiler-ncclscope.so", multiarch()),
            "-rw-r--r--",
        ),
        ("/usr/lib/systemd/system/ncclscope.service", "-rw-r--r--"),
        ("/usr/lib/systemd/system/ncclscope.socket", "-rw-r--r--"),
        ("/usr/lib/sysusers.d/ncclscope.conf", "-rw-r--r--"),
        ("/etc/ncclscope/ncclscope.toml", "-rw-r--r--"),
        ("/etc/ncclscope/slurm.env", "-rw-r--r--"),
        ("/usr/lib/ncclscope/slurm/task-prolog", "-rwxr-xr-x"),
        ("/usr/lib/ncclscope/slurm/epilog", "-rwxr-xr-x"),
        ("/usr/share/ncclscope/grafana-dashboard.json", "-rw-r--r--"),
        ("/usr/share/ncclscope/otel-collector.yaml", "-rw-r--r--"),
        (
            "/usr/share/ncclscope/prometheus/ncclscope-rules.yaml",
            "-rw-r--r--",
        ),
        (
            "/usr/share/ncclscope/prometheus/prometheus-scrape.yml",
            "-rw-r--r--",
        ),
        ("/usr/share/ncclscope/enroot/ncclscope.fstab", "-rw-r--r--"),
        ("/usr/share/doc/ncclscope/README.md", "-rw-r--r--"),
        (
            "/usr/share/doc/ncclscope/docs/operator-guide.md",
            "-rw-r--r--",
        ),
        (
            "/usr/share/doc/ncclscope/docs/troubleshooting.md",
            "-rw-r--r--",
        ),
        (
            "/usr/share/doc/ncclscope/docs/configuration.md",
            "-rw-r--r--",
        ),
        ("/usr/share/doc/ncclscope/docs/metrics.md", "-rw-r--r--"),
        (
            "/usr/share/doc/ncclscope/docs/how-it-works.md",
            "-rw-r--r--",
        ),
        ("/usr/share/doc/ncclscope/copyright", "-rw-r--r--"),
    ]
    .into_iter()
    .map(|(p, m)| (p.to_string(), m.to_string()))
    .collect();
    assert_eq!(files, want, "{listing}");

    let control = run(Command::new("dpkg-deb").arg("--field").arg(&deb).args([
        "Package",
        "Version",
        "Architecture",
        "Depends",
    ]));
    assert_eq!(
        control,
        format!(
            "Package: ncclscope\nVersion: {}\nArchitecture: {}\nDepends: libc6 (>= 2.34)\n",
            env!("CARGO_PKG_VERSION"),
            arch()
        )
    );
    let ctrl = tempfile::tempdir().unwrap();
    run(Command::new("dpkg-deb")
        .arg("--control")
        .arg(&deb)
        .arg(ctrl.path()));
    assert_eq!(
        std::fs::read_to_string(ctrl.path().join("conffiles")).unwrap(),
        "/etc/ncclscope/ncclscope.toml\n/etc/ncclscope/slurm.env\n",
        "an operator's edits to the configuration survive upgrades"
    );

    // NCCL_PROFILER_PLUGIN=ncclscope makes NCCL dlopen("libnccl-profiler-ncclscope.so"): the directory
    // must be one the dynamic loader searches.
    let plugin_dir = Path::new("/usr/lib").join(multiarch());
    let searched = run(Command::new("ldconfig").args(["-N", "-v"]));
    let searched: Vec<PathBuf> = searched
        .lines()
        .filter(|l| l.starts_with('/'))
        .filter_map(|l| std::fs::canonicalize(l.split(':').next().unwrap()).ok())
        .collect();
    assert!(
        searched.contains(&std::fs::canonicalize(&plugin_dir).unwrap()),
        "{} is not in the loader's path {searched:?}",
        plugin_dir.display()
    );
}

/// A root with the host's systemd units (the targets ours hang off), into which dpkg installs.
struct Root(tempfile::TempDir);

impl Root {
    fn new() -> Root {
        let root = tempfile::tempdir().unwrap();
        let dpkg = root.path().join("var/lib/dpkg");
        std::fs::create_dir_all(dpkg.join("info")).unwrap();
        std::fs::create_dir_all(dpkg.join("updates")).unwrap();
        std::fs::write(dpkg.join("status"), "").unwrap();
        std::fs::create_dir_all(root.path().join("lib/systemd")).unwrap();
        run(Command::new("cp")
            .arg("-a")
            .arg("/usr/lib/systemd/system")
            .arg(root.path().join("lib/systemd/")));
        Root(root)
    }

    fn path(&self, p: &str) -> PathBuf {
        self.0.path().join(p.trim_start_matches('/'))
    }

    /// dpkg ARGS on this root; the maintainer scripts run on the host with DPKG_ROOT set, as they
    /// would inside it (no shell in the scratch root to chroot into).
    fn dpkg(&self, args: &[&std::ffi::OsStr]) -> String {
        self.dpkg_with_path(args, &std::env::var_os("PATH").unwrap())
    }

    fn dpkg_with_path(&self, args: &[&std::ffi::OsStr], path: &std::ffi::OsStr) -> String {
        run(Command::new("dpkg")
            .env("PATH", path)
            .arg(format!("--root={}", self.0.path().display()))
            .args([
                "--force-script-chrootless",
                "--force-depends",
                "--log=/dev/null",
            ])
            .args(args))
    }

    fn analyze(&self, args: &[&str]) -> std::process::Output {
        Command::new("systemd-analyze")
            .args(args)
            .arg(format!("--root={}", self.0.path().display()))
            .output()
            .expect("systemd-analyze (systemd) is needed")
    }
}

#[test]
fn installed_by_dpkg_it_creates_its_user_enables_its_units_and_they_verify() {
    let deb = deb();
    let root = Root::new();
    root.dpkg(&["--install".as_ref(), deb.as_os_str()]);

    let passwd = std::fs::read_to_string(root.path("/etc/passwd")).unwrap();
    let user = passwd
        .lines()
        .find(|l| l.starts_with("ncclscope:"))
        .unwrap_or_else(|| panic!("no ncclscope user: {passwd}"));
    assert!(user.ends_with(":/usr/sbin/nologin"), "{user}");
    for link in [
        "/etc/systemd/system/sockets.target.wants/ncclscope.socket",
        "/etc/systemd/system/multi-user.target.wants/ncclscope.service",
    ] {
        let target = std::fs::read_link(root.path(link))
            .unwrap_or_else(|e| panic!("{link} (enabled by postinst): {e}"));
        assert!(
            target.ends_with(Path::new(link).file_name().unwrap()),
            "{target:?}"
        );
    }

    // An upgrade (here: the same package again) keeps an administrator's choice to disable them.
    run(Command::new("systemctl")
        .arg(format!("--root={}", root.0.path().display()))
        .args(["disable", "ncclscope.service"]));
    root.dpkg(&["--install".as_ref(), deb.as_os_str()]);
    assert!(
        root.path("/etc/systemd/system/multi-user.target.wants/ncclscope.service")
            .symlink_metadata()
            .is_err(),
        "postinst enabled a service the administrator had disabled"
    );
    let socket_link = root.path("/etc/systemd/system/sockets.target.wants/ncclscope.socket");
    let service_link = root.path("/etc/systemd/system/multi-user.target.wants/ncclscope.service");
    assert!(socket_link.is_symlink());
    // Removed (the units disabled with it) and installed again: enabled again.
    root.dpkg(&["--remove".as_ref(), "ncclscope".as_ref()]);
    assert!(!socket_link.is_symlink() && !service_link.is_symlink());
    root.dpkg(&["--install".as_ref(), deb.as_os_str()]);
    assert!(socket_link.is_symlink() && service_link.is_symlink());

    let verify = root.analyze(&["verify", "ncclscope.socket", "ncclscope.service"]);
    assert!(
        verify.status.success() && verify.stdout.is_empty() && verify.stderr.is_empty(),
        "systemd-analyze verify of the installed units: {verify:?}"
    );
    // The exposure docs/operator-guide.md states (1.2 on systemd 252) for the installed unit, not only the copy in deploy/.
    let security = root.analyze(&[
        "security",
        "--offline=true",
        "--threshold=12",
        "ncclscope.service",
    ]);
    assert!(
        security.status.success(),
        "{}",
        String::from_utf8_lossy(&security.stdout)
    );
    let unit =
        std::fs::read_to_string(root.path("/usr/lib/systemd/system/ncclscope.service")).unwrap();
    assert!(
        unit.contains(
            "\nExecStart=/usr/bin/ncclscope daemon --config /etc/ncclscope/ncclscope.toml\n"
        ),
        "{unit}"
    );
    // The Slurm scripts name the plugin where the package put it.
    let slurm = std::fs::read_to_string(root.path("/etc/ncclscope/slurm.env")).unwrap();
    let plugin = format!("/usr/lib/{}/libnccl-profiler-ncclscope.so", multiarch());
    assert!(
        slurm.contains(&format!("\nNCCLSCOPE_SLURM_PLUGIN={plugin}\n")),
        "{slurm}"
    );
    assert!(root.path(&plugin).is_file());

    // The packaged daemon: the operator commands, no demo, no fake NCCL host linked.
    let bin = root.path("/usr/bin/ncclscope");
    let help = run(Command::new(&bin).arg("--help"));
    for cmd in [
        "daemon",
        "top",
        "stats",
        "export",
        "cluster",
        "reference",
        "systemd-dropin",
    ] {
        assert!(help.contains(&format!("\n  {cmd} ")), "{help}");
    }
    let demo = Command::new(&bin).arg("demo").output().unwrap();
    assert!(!demo.status.success());
    assert!(
        String::from_utf8_lossy(&demo.stderr).contains("unrecognized subcommand 'demo'"),
        "{demo:?}"
    );
    let symbols = run(Command::new("nm").arg(&bin));
    assert!(
        symbols
            .lines()
            .filter(|l| l.contains("ncclscope..engine"))
            .count()
            > 0,
        "the packaged daemon keeps its symbols (else this check says nothing)"
    );
    let test_code: Vec<&str> = symbols
        .lines()
        .filter(|l| l.contains("fakenccl") || l.contains("sim_rank"))
        .collect();
    assert!(
        test_code.is_empty(),
        "test code in the packaged daemon: {test_code:?}"
    );

    let plugin_so = root.path(&format!(
        "/usr/lib/{}/libnccl-profiler-ncclscope.so",
        multiarch()
    ));

    // The plugin carries the device hook (compiled by nvcc with its register cap; docs/how-it-works.md, "Device hook").
    let so = std::fs::read(&plugin_so).unwrap();
    assert!(
        so.windows(16).any(|w| w == b"-maxrregcount 32"),
        "the packaged plugin has no device hook"
    );

    // Depends: libc6 (>= 2.34) holds for what the binaries link (a build on a newer distribution
    // could ask for more).
    for file in [&bin, &plugin_so] {
        let dynsyms = run(Command::new("objdump").arg("-T").arg(file));
        let newest = dynsyms
            .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
            .filter_map(|w| w.strip_prefix("GLIBC_"))
            .filter_map(|v| {
                let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
                Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
            })
            .max()
            .unwrap();
        assert!(newest <= (2, 34), "{}: GLIBC_{newest:?}", file.display());
    }

    // Purge: the files, the configuration and the units' links go; the user stays (Debian's custom).
    root.dpkg(&["--purge".as_ref(), "ncclscope".as_ref()]);
    for gone in [
        "/usr/bin/ncclscope",
        "/etc/ncclscope/ncclscope.toml",
        "/etc/systemd/system/sockets.target.wants/ncclscope.socket",
        "/etc/systemd/system/multi-user.target.wants/ncclscope.service",
    ] {
        assert!(
            !root.path(gone).exists() && root.path(gone).symlink_metadata().is_err(),
            "{gone} after purge"
        );
    }
}

/// A directory of links to every command of this machine but `hidden`: a PATH as on a slim image.
fn path_without(hidden: &[&str], dir: &Path) -> std::ffi::OsString {
    std::fs::create_dir(dir).unwrap();
    for d in [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ] {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        for e in entries {
            let e = e.unwrap();
            let link = dir.join(e.file_name());
            if !hidden.contains(&e.file_name().to_str().unwrap_or(""))
                && link.symlink_metadata().is_err()
            {
                std::os::unix::fs::symlink(e.path(), link).unwrap();
            }
        }
    }
    dir.as_os_str().to_owned()
}

/// The container image installs the package on debian:bookworm-slim, which has neither systemd nor
/// adduser: the maintainer scripts must succeed there, enabling and creating nothing. (Under
/// DPKG_ROOT postinst never calls adduser; hiding it keeps the PATH that of the image.)
#[test]
fn where_neither_systemd_nor_adduser_exists_it_installs_and_enables_nothing() {
    let deb = deb();
    let root = Root::new();
    let bin = tempfile::tempdir().unwrap();
    let path = path_without(
        &["systemctl", "systemd-sysusers", "adduser"],
        &bin.path().join("bin"),
    );
    root.dpkg_with_path(&["--install".as_ref(), deb.as_os_str()], &path);
    assert!(root.path("/usr/bin/ncclscope").is_file());
    assert!(root.path("/etc/ncclscope/ncclscope.toml").is_file());
    assert!(!root.path("/etc/systemd/system").exists());
    assert!(!root.path("/etc/passwd").exists());
    root.dpkg_with_path(&["--purge".as_ref(), "ncclscope".as_ref()], &path);
    assert!(!root.path("/usr/bin/ncclscope").exists());
}

/// Issue 39: the unit allows localhost only (`IPAddressDeny=any`), which blocked the documented
/// remote scrape and a collector on another host until an operator edited the unit. Configured in
/// ncclscope.toml, `ncclscope systemd-dropin` writes the drop-in that lets them through: systemd
/// reads it (verify is clean, `security` sees the non-localhost allow list) and nothing else of the
/// unit's hardening changes.
#[test]
fn the_dropin_lets_the_configured_collector_and_scrapers_through_the_unit() {
    let root = Root::new();
    let units = root.path("/etc/systemd/system");
    std::fs::create_dir_all(&units).unwrap();
    for unit in ["ncclscope.service", "ncclscope.socket"] {
        let from = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(unit);
        std::fs::copy(from, units.join(unit)).unwrap();
    }
    // The unit's ExecStart (deploy/'s copy names /usr/local/bin): this build's binary.
    let bin = root.path("/usr/local/bin/ncclscope");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    let built = ncclscope_tests::daemon_binary();
    std::fs::hard_link(&built, &bin)
        .or_else(|_| std::fs::copy(&built, &bin).map(drop))
        .unwrap();
    let ip_line = |root: &Root| {
        let out = root.analyze(&["security", "--offline=true", "ncclscope.service"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (text.lines())
            .find(|l| l.contains("IPAddressDeny="))
            .unwrap_or_else(|| panic!("{text}"))
            .to_string()
    };
    assert!(ip_line(&root).contains("only localhost entries"));

    let config = root.path("/etc/ncclscope/ncclscope.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        "[otlp]\nendpoint = \"http://10.20.30.40:4317\"\n\
         [prometheus]\nlisten = \"0.0.0.0:9464\"\nremote_scrapers = \"10.1.0.0/16\"\n",
    )
    .unwrap();
    let dropin = root.path("/etc/systemd/system/ncclscope.service.d/network.conf");
    run(Command::new(&built)
        .arg("systemd-dropin")
        .arg("--config")
        .arg(&config)
        .arg("--output")
        .arg(&dropin));
    let text = std::fs::read_to_string(&dropin).unwrap();
    let allowed: Vec<&str> = (text.lines())
        .filter_map(|l| l.strip_prefix("IPAddressAllow="))
        .collect();
    assert_eq!(allowed, ["10.20.30.40", "10.1.0.0/16"], "{text}");
    let verify = root.analyze(&["verify", "ncclscope.socket", "ncclscope.service"]);
    assert!(
        verify.status.success() && verify.stdout.is_empty() && verify.stderr.is_empty(),
        "systemd-analyze verify with the drop-in: {verify:?}"
    );
    assert!(
        ip_line(&root).contains("non-localhost entries"),
        "{}",
        ip_line(&root)
    );
    let security = root.analyze(&[
        "security",
        "--offline=true",
        "--threshold=13",
        "ncclscope.service",
    ]);
    assert!(
        security.status.success(),
        "{}",
        String::from_utf8_lossy(&security.stdout)
    );
}
