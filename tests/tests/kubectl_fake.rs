//! The real `kubectl` against `tests/kubernetes/kube_cluster.py` (issue 30): the fake Kubernetes must
//! be an API server a real client accepts, or the kubernetes backend's tests prove less than they say.
//! kubectl discovers the fake's resources, creates, applies, lists, describes and watches pods through
//! it, and checks RBAC against it: `auth can-i` for the coordinator's ServiceAccount (what
//! `infra/k8s/rbac.yaml` grants, and nothing more), `auth can-i --list`, `auth whoami`, and
//! impersonation, which the fake refuses (403) to a caller without RBAC's `impersonate` and allows,
//! for exactly what was granted, once a Role grants it. Each check also asserts what a real server
//! refuses.
//!
//! Discovery, create, describe, RBAC and impersonation run again with Debian 12's own kubectl (1.20:
//! legacy discovery, OpenAPI v2) where `PHYSALIA_KUBECTL_1_20` names it (.ci/run unpacks the package).
//!
//! Credentials are files (mode 0400) that the kubeconfigs name (`tokenFile`), never arguments or
//! environment. Skipped, with a note, where `kubectl` is not installed, no Docker Engine answers or
//! moto is not installed (`PHYSALIA_REQUIRE_MOTO=1` makes a missing moto fail instead).

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use physalia_testkit::{Emulator, Spawn};
use serde_json::{Value, json};
use tempfile::TempDir;

/// The coordinator's ServiceAccount, as RBAC names it.
const COORDINATOR: &str = "system:serviceaccount:physalia:physalia-coordinator";
/// Its token, as `kube_cluster.py` makes ServiceAccount tokens.
const COORDINATOR_TOKEN: &str = "sa.physalia.physalia-coordinator";
/// An image no test builds: the fake's kubelet leaves the pod waiting (`ErrImageNeverPull`).
const ABSENT_IMAGE: &str = "physalia-kubectl-test-absent:1";

/// The fake and two kubeconfigs for it: the administrator's and the coordinator ServiceAccount's.
struct Fake {
    _fake: Emulator,
    /// The kubectl program: `kubectl` on PATH, or Debian's (see [`debian_kubectl`]).
    kubectl: String,
    dir: TempDir,
    admin: PathBuf,
    coordinator: PathBuf,
}

/// Why `kubectl` cannot run here, if it cannot.
fn no_kubectl(kubectl: &str) -> Option<String> {
    match Command::new(kubectl).args(["version", "--client"]).output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "`kubectl version --client` failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Some(format!("no {kubectl} ({e})")),
    }
}

/// Writes `text` to a new file only its owner may read (mode 0400).
fn secret_file(path: &Path, text: &str) {
    physalia_tests::secret_file(path, text, 0o400);
}

impl Fake {
    fn start() -> Option<Fake> {
        Fake::start_with("kubectl")
    }

    /// The fake, driven by the `kubectl` program.
    fn start_with(kubectl: &str) -> Option<Fake> {
        if let Some(why) = no_kubectl(kubectl) {
            eprintln!("skipping: {why}");
            return None;
        }
        let fake = Spawn::new("tests/kubernetes/kube_cluster.py")
            .docker()
            .root("the pods' NetworkPolicy rules are netfilter rules (iptables)")
            .python(&["moto", "boto3", "cryptography", "yaml"])
            .start()?;
        let dir = TempDir::new().unwrap();
        // the fake's own kubeconfig names its server and CA; the user comes from a token file here
        let theirs: Value =
            serde_json::from_str(&fs::read_to_string(fake.str("kubeconfig")).unwrap()).unwrap();
        let write = |name: &str, token: &str| -> PathBuf {
            let token_file = dir.path().join(format!("{name}.token"));
            secret_file(&token_file, token);
            let config = json!({
                "apiVersion": "v1", "kind": "Config", "current-context": name,
                "clusters": theirs["clusters"],
                "users": [{"name": name, "user": {"tokenFile": token_file}}],
                "contexts": [{"name": name, "context": {
                    "cluster": theirs["clusters"][0]["name"], "user": name, "namespace": "physalia"}}],
            });
            let path = dir.path().join(format!("{name}.kubeconfig"));
            secret_file(&path, &config.to_string());
            path
        };
        let admin = write("admin", fake.str("user_token"));
        let coordinator = write("coordinator", COORDINATOR_TOKEN);
        Some(Fake {
            _fake: fake,
            kubectl: kubectl.to_string(),
            dir,
            admin,
            coordinator,
        })
    }

    /// `kubectl ARGS` with `config`; its discovery cache in the test's folder.
    fn command(&self, config: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.env("KUBECONFIG", config)
            .env("HOME", self.dir.path())
            .arg(format!(
                "--cache-dir={}",
                self.dir.path().join("cache").display()
            ))
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, config: &Path, args: &[&str]) -> Output {
        self.command(config, args)
            .arg("--request-timeout=30s")
            .output()
            .unwrap()
    }

    /// `kubectl ARGS` as the administrator, which must succeed: its standard output.
    #[track_caller]
    fn ok(&self, args: &[&str]) -> String {
        ok(&self.run(&self.admin, args), args)
    }

    /// `kubectl ARGS` as the administrator, which must fail: its standard error.
    #[track_caller]
    fn refused(&self, args: &[&str]) -> String {
        refused(&self.run(&self.admin, args), args)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

#[track_caller]
fn ok(out: &Output, args: &[&str]) -> String {
    assert!(
        out.status.success(),
        "kubectl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[track_caller]
fn refused(out: &Output, args: &[&str]) -> String {
    assert!(
        !out.status.success(),
        "kubectl {args:?} succeeded where a real server refuses: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The whitespace-separated fields of the line of `table` whose first field is `first`.
#[track_caller]
fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&first))
        .unwrap_or_else(|| panic!("no row {first} in:\n{table}"))
}

fn pod_manifest(name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels:\n    app: kubectl-test\nspec:\n  containers:\n  - name: main\n    image: {ABSENT_IMAGE}\n"
    )
}

/// Discovery, create (with the server's strict field validation), get (server-side printing, `-o
/// wide`), describe, logs, wait, resourceVersions that count up, and a watch that sees a pod come and
/// go.
#[test]
fn kubectl_discovers_lists_describes_and_watches_the_fake() {
    let Some(k) = Fake::start() else { return };

    // discovery: kubectl's (aggregated) and the legacy documents
    let resources = k.ok(&["api-resources"]);
    assert_eq!(
        row(&resources, "pods"),
        ["pods", "po", "v1", "true", "Pod"],
        "{resources}"
    );
    assert_eq!(
        row(&resources, "jobs"),
        ["jobs", "batch/v1", "true", "Job"],
        "{resources}"
    );
    assert_eq!(
        row(&resources, "rolebindings"),
        [
            "rolebindings",
            "rbac.authorization.k8s.io/v1",
            "true",
            "RoleBinding"
        ],
        "{resources}"
    );
    let batch: Value = serde_json::from_str(&k.ok(&["get", "--raw", "/apis/batch/v1"])).unwrap();
    let jobs = batch["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "jobs")
        .unwrap_or_else(|| panic!("no jobs in {batch}"));
    assert_eq!(jobs["singularName"], "job", "{jobs}");
    assert_eq!(jobs["namespaced"], true, "{jobs}");
    assert!(
        jobs["verbs"].as_array().unwrap().contains(&json!("watch")),
        "{jobs}"
    );
    let core: Value = serde_json::from_str(&k.ok(&["get", "--raw", "/api/v1"])).unwrap();
    assert!(
        core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "pods/log" && r["verbs"] == json!(["get"])),
        "{core}"
    );
    // a resource the fake does not serve is one kubectl does not know
    let unknown = k.refused(&["get", "deployments"]);
    assert!(
        unknown.contains("the server doesn't have a resource type \"deployments\""),
        "{unknown}"
    );

    // create; a field Pods do not have is refused, as the API server's strict field validation does
    fs::write(k.path("p1.yaml"), pod_manifest("p1")).unwrap();
    k.ok(&["create", "-f", k.path("p1.yaml").to_str().unwrap()]);
    fs::write(k.path("bad.yaml"), pod_manifest("bad") + "bogus: 1\n").unwrap();
    let bad = k.refused(&["create", "-f", k.path("bad.yaml").to_str().unwrap()]);
    assert!(bad.contains("unknown field \"bogus\""), "{bad}");
    // kubectl wait watches the pod until the kubelet found no image
    k.ok(&[
        "wait",
        "pod/p1",
        "--for=jsonpath={.status.containerStatuses[0].state.waiting.reason}=ErrImageNeverPull",
        "--timeout=30s",
    ]);

    // get: the server's Tables
    let both = k.ok(&["get", "pods,jobs"]);
    assert_eq!(
        row(&both, "pod/p1")[..4],
        ["pod/p1", "0/1", "ErrImageNeverPull", "0"],
        "{both}"
    );
    let wide = k.ok(&["get", "pods", "-o", "wide"]);
    assert_eq!(
        row(&wide, "NAME"),
        [
            "NAME",
            "READY",
            "STATUS",
            "RESTARTS",
            "AGE",
            "IP",
            "NODE",
            "NOMINATED",
            "NODE",
            "READINESS",
            "GATES"
        ],
        "{wide}"
    );
    // no requests: the scheduler binds it to the first node, one of the AKS system pool
    assert_eq!(row(&wide, "p1")[6], "aks-system-0", "{wide}");
    let none = k.ok(&["get", "pods", "-l", "app notin (kubectl-test)"]);
    assert!(!none.contains("p1"), "{none}");

    // describe and logs
    let described = k.ok(&["describe", "pod", "p1"]);
    for want in [
        "Namespace:    physalia",
        "Node:         aks-system-0",
        "Labels:       app=kubectl-test",
        &format!("Image:          {ABSENT_IMAGE}"),
        "Reason:       ErrImageNeverPull",
    ] {
        assert!(described.contains(want), "no {want:?} in:\n{described}");
    }
    let logs = k.refused(&["logs", "p1"]);
    assert!(
        logs.contains("container \"main\" in pod \"p1\" is waiting to start: ErrImageNeverPull"),
        "{logs}"
    );
    let missing = k.refused(&["describe", "pod", "nope"]);
    assert!(missing.contains("pods \"nope\" not found"), "{missing}");

    // every change gets a newer resourceVersion
    let rv = |k: &Fake| -> u64 {
        k.ok(&[
            "get",
            "pod",
            "p1",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ])
        .parse()
        .unwrap()
    };
    let before = rv(&k);
    k.ok(&["label", "pod", "p1", "seen=yes"]);
    let after = rv(&k);
    assert!(after > before, "{before} -> {after}");

    // client-side apply: a strategic merge patch, containers merged by name
    let changed = pod_manifest("p1")
        .replace("app: kubectl-test\n", "app: kubectl-test\n    tier: a\n")
        .replace(ABSENT_IMAGE, "physalia-kubectl-test-absent:2");
    fs::write(k.path("p1-changed.yaml"), changed).unwrap();
    k.ok(&["apply", "-f", k.path("p1-changed.yaml").to_str().unwrap()]);
    let applied = k.ok(&[
        "get",
        "pod",
        "p1",
        "-o",
        "jsonpath={.metadata.labels.tier} {.spec.containers[*].name} {.spec.containers[*].image}",
    ]);
    assert_eq!(applied, "a main physalia-kubectl-test-absent:2");

    // a watch: kubectl lists (p1), then watches from the list's resourceVersion, so p2's coming and
    // going after the list are events whenever the watch itself starts
    let mut watch = k
        .command(
            &k.admin,
            &[
                "get",
                "pods",
                "--watch",
                "--output-watch-events",
                "--request-timeout=60s",
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut wait_for = |event: &str, pod: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.split_whitespace().take(2).eq([event, pod]);
                    seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!(
                    "the watch never said {event} {pod}; it said:\n{}",
                    seen.join("\n")
                ),
            }
        }
    };
    wait_for("ADDED", "p1");
    fs::write(k.path("p2.yaml"), pod_manifest("p2")).unwrap();
    k.ok(&["create", "-f", k.path("p2.yaml").to_str().unwrap()]);
    wait_for("ADDED", "p2");
    k.ok(&["delete", "pod", "p2"]);
    wait_for("DELETED", "p2");
    let _ = watch.kill();
    let _ = watch.wait();
}

/// `kubectl auth` against the fake's RBAC: what `infra/k8s/rbac.yaml` grants the coordinator and
/// nothing more, its own view of that, and impersonation refused until a Role grants it, then
/// allowed for exactly what was granted.
#[test]
fn kubectl_checks_rbac_and_impersonation_against_the_fake() {
    let Some(k) = Fake::start() else { return };
    let as_coordinator = format!("--as={COORDINATOR}");

    // the administrator impersonates the coordinator (system:masters may)
    let can = |args: &[&str]| -> (bool, String) {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        let out = k.run(&k.admin, &all);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    };
    assert_eq!(
        can(&["create", "jobs.batch", &as_coordinator]),
        (true, "yes".to_string())
    );
    assert_eq!(
        can(&["get", "pods", "--subresource=log", &as_coordinator]),
        (true, "yes".to_string())
    );
    for refused in [["create", "pods"], ["get", "secrets"], ["list", "nodes"]] {
        assert_eq!(
            can(&[refused[0], refused[1], &as_coordinator]),
            (false, "no".to_string()),
            "{refused:?}"
        );
    }
    assert_eq!(can(&["create", "pods"]), (true, "yes".to_string()));

    let list = k.ok(&["auth", "can-i", "--list", &as_coordinator]);
    assert_eq!(
        row(&list, "jobs.batch")[3..],
        ["[create", "get", "patch", "delete]"],
        "{list}"
    );
    assert_eq!(row(&list, "pods")[3..], ["[list", "delete]"], "{list}");
    assert!(
        !list
            .lines()
            .any(|l| l.starts_with("secrets ") && l.contains("get")),
        "{list}"
    );

    let who: Value =
        serde_json::from_str(&k.ok(&["auth", "whoami", &as_coordinator, "-o", "json"])).unwrap();
    assert_eq!(who["status"]["userInfo"]["username"], COORDINATOR, "{who}");
    assert!(
        who["status"]["userInfo"]["groups"]
            .as_array()
            .unwrap()
            .contains(&json!("system:serviceaccounts:physalia")),
        "{who}"
    );

    // the coordinator with its own token: what its Role grants, 403 for the rest
    let sa = |args: &[&str]| k.run(&k.coordinator, args);
    let me = ok(&sa(&["auth", "whoami"]), &["auth", "whoami"]);
    assert!(me.contains(COORDINATOR), "{me}");
    the_coordinator_gets_its_role_and_no_more(&k);
    let watch = refused(
        &sa(&["get", "pods", "--watch-only", "--request-timeout=5s"]),
        &["get", "pods", "--watch-only"],
    );
    assert!(watch.contains("cannot watch resource \"pods\""), "{watch}");

    // impersonation without RBAC's impersonate: 403 for ServiceAccounts as for users (the helper's)
    let default_sa = "--as=system:serviceaccount:physalia:default";
    let args = ["get", "pods", default_sa];
    let err = refused(&sa(&args), &args);
    assert!(
        err.contains(&format!(
            "serviceaccounts \"default\" is forbidden: User \"{COORDINATOR}\" cannot impersonate resource \"serviceaccounts\" in API group \"\" in the namespace \"physalia\""
        )),
        "{err}"
    );

    // the administrator grants impersonating the `default` ServiceAccount, and only it
    k.ok(&[
        "create",
        "role",
        "impersonate-default",
        "--verb=impersonate",
        "--resource=serviceaccounts",
        "--resource-name=default",
    ]);
    k.ok(&[
        "create",
        "rolebinding",
        "impersonate-default",
        "--role=impersonate-default",
        "--serviceaccount=physalia:physalia-coordinator",
    ]);
    let now = ok(&sa(&["auth", "whoami", default_sa]), &["auth", "whoami"]);
    assert!(
        now.contains("system:serviceaccount:physalia:default"),
        "{now}"
    );
    // ... and the request is then authorized as `default`, which may not list pods
    let as_default = refused(&sa(&["get", "pods", default_sa]), &["get", "pods"]);
    assert!(
        as_default.contains(
            "pods is forbidden: User \"system:serviceaccount:physalia:default\" cannot list resource \"pods\""
        ),
        "{as_default}"
    );
    // the grant names `default`: another ServiceAccount, or a group on top, stays refused
    let other = refused(
        &sa(&[
            "get",
            "pods",
            "--as=system:serviceaccount:physalia:physalia-coordinator",
        ]),
        &["get", "pods", "--as=coordinator"],
    );
    assert!(other.contains("cannot impersonate"), "{other}");
    let group = refused(
        &sa(&["get", "pods", default_sa, "--as-group=system:masters"]),
        &["get", "pods", "--as-group=system:masters"],
    );
    assert!(
        group.contains("groups \"system:masters\" is forbidden"),
        "{group}"
    );
}

/// Debian 12's own kubectl (the `kubernetes-client` package, 1.20), which `.ci/run` unpacks and names in
/// `PHYSALIA_KUBECTL_1_20`; None (the test skips, with a note) where it is not there, and a failure
/// where `PHYSALIA_REQUIRE_KUBECTL_1_20=1` says it must be.
fn debian_kubectl() -> Option<String> {
    match std::env::var("PHYSALIA_KUBECTL_1_20") {
        Ok(path) if !path.is_empty() => Some(path),
        _ => {
            assert!(
                std::env::var("PHYSALIA_REQUIRE_KUBECTL_1_20").as_deref() != Ok("1"),
                "PHYSALIA_REQUIRE_KUBECTL_1_20=1 but PHYSALIA_KUBECTL_1_20 names no kubectl"
            );
            eprintln!(
                "skipping: PHYSALIA_KUBECTL_1_20 is not set (`apt-get download kubernetes-client` and \
                 `dpkg -x` it, as .ci/run does)"
            );
            None
        }
    }
}

/// Issue 30: Debian's kubectl 1.20 (no aggregated discovery, OpenAPI v2 before it creates from a file,
/// `auth can-i` without `whoami`) lists, creates, describes and checks RBAC against the fake as the
/// current kubectl does, impersonation refused the same way.
#[test]
fn debian_kubectl_1_20_lists_describes_and_checks_rbac() {
    let Some(kubectl) = debian_kubectl() else {
        return;
    };
    let Some(k) = Fake::start_with(&kubectl) else {
        return;
    };
    let version = k.ok(&["version", "--client", "--short"]);
    assert!(version.contains("v1.20."), "{version}");

    // discovery, without the aggregated documents
    let resources = k.ok(&["api-resources"]);
    assert_eq!(
        row(&resources, "pods"),
        ["pods", "po", "v1", "true", "Pod"],
        "{resources}"
    );
    assert_eq!(
        row(&resources, "networkpolicies"),
        [
            "networkpolicies",
            "netpol",
            "networking.k8s.io/v1",
            "true",
            "NetworkPolicy"
        ],
        "{resources}"
    );

    // create from a file: 1.20 reads OpenAPI v2 first (a 404 there fails it)
    fs::write(k.path("p1.yaml"), pod_manifest("p1")).unwrap();
    let created = k.ok(&["create", "-f", k.path("p1.yaml").to_str().unwrap()]);
    assert_eq!(created.trim(), "pod/p1 created");
    k.ok(&[
        "wait",
        "pod/p1",
        "--for=condition=PodScheduled",
        "--timeout=30s",
    ]);
    let pods = k.ok(&["get", "pods", "-o", "wide"]);
    assert_eq!(row(&pods, "p1")[6], "aks-system-0", "{pods}");
    let described = k.ok(&["describe", "pod", "p1"]);
    for want in [
        "Namespace:    physalia",
        "Labels:       app=kubectl-test",
        &format!("Image:          {ABSENT_IMAGE}"),
    ] {
        assert!(described.contains(want), "no {want:?} in:\n{described}");
    }
    // infra/k8s's NetworkPolicy, which the fake applies and enforces
    let policy = k.ok(&["describe", "networkpolicy", "physalia-members-only"]);
    assert!(
        policy.contains("PodSelector:     app.kubernetes.io/name=physalia"),
        "{policy}"
    );

    // RBAC: what infra/k8s/rbac.yaml grants the coordinator, and nothing more
    let as_coordinator = format!("--as={COORDINATOR}");
    let can = |verb: &str, what: &str| -> String {
        let out = k.run(&k.admin, &["auth", "can-i", verb, what, &as_coordinator]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(can("create", "jobs.batch"), "yes");
    assert_eq!(can("get", "secrets"), "no");
    assert_eq!(can("create", "pods"), "no");
    let list = k.ok(&["auth", "can-i", "--list", &as_coordinator]);
    assert_eq!(
        row(&list, "jobs.batch")[3..],
        ["[create", "get", "patch", "delete]"],
        "{list}"
    );

    // the coordinator with its own token: 403 beyond its Role, and for impersonation
    the_coordinator_gets_its_role_and_no_more(&k);
}

/// kubectl with the coordinator's own token: what its Role grants (listing pods), 403 worded as RBAC
/// words it beyond that (listing Jobs) and for impersonating a user without RBAC's `impersonate`.
#[track_caller]
fn the_coordinator_gets_its_role_and_no_more(k: &Fake) {
    let sa = |args: &[&str]| k.run(&k.coordinator, args);
    ok(&sa(&["get", "pods"]), &["get", "pods"]);
    let jobs = refused(&sa(&["get", "jobs"]), &["get", "jobs"]);
    assert!(
        jobs.contains(&format!(
            "jobs.batch is forbidden: User \"{COORDINATOR}\" cannot list resource \"jobs\" in API group \"batch\" in the namespace \"physalia\""
        )),
        "{jobs}"
    );
    let args = ["get", "pods", "--as=physalia-test-user"];
    let err = refused(&sa(&args), &args);
    assert!(
        err.contains(&format!(
            "users \"physalia-test-user\" is forbidden: User \"{COORDINATOR}\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"
        )),
        "{err}"
    );
}
