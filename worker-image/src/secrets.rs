//! `physalia-worker unpack-secrets`: turns a secret bundle handed over in an environment variable into
//! files, for platforms that inject secrets only as environment values (AWS ECS). It runs as the task's
//! short-lived init container; the worker container starts after it exits 0, reads the files from
//! `PHYSALIA_SECRETS_DIR` like on every other platform, and never has the bundle in its environment.
//!
//! The bundle (written by `physalia_backends::ecs::task::secret_bundle`) is a JSON object from file name
//! to the file's bytes in standard base64.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use base64::Engine;

use physalia_control::env::ENV_SECRETS_DIR;

/// The variable holding the bundle.
pub const ENV_SECRET_BUNDLE: &str = "PHYSALIA_SECRET_BUNDLE";
/// Optional `uid:gid` the folder and files are given to (the unpacker runs as root, the worker does not).
pub const ENV_SECRETS_OWNER: &str = "PHYSALIA_SECRETS_OWNER";

/// Reads the bundle, the folder and the owner from the environment and writes the files. Returns the
/// names written (never their contents).
pub fn unpack_from_env() -> Result<Vec<String>> {
    let bundle = std::env::var(ENV_SECRET_BUNDLE)
        .with_context(|| format!("{ENV_SECRET_BUNDLE} is not set (or not UTF-8)"))?;
    let dir: PathBuf = std::env::var_os(ENV_SECRETS_DIR)
        .with_context(|| format!("{ENV_SECRETS_DIR} is not set"))?
        .into();
    let owner = match std::env::var(ENV_SECRETS_OWNER) {
        Ok(s) => Some(parse_owner(&s)?),
        Err(_) => None,
    };
    unpack(&bundle, &dir, owner)
}

fn parse_owner(s: &str) -> Result<(u32, u32)> {
    let parsed = s
        .split_once(':')
        .and_then(|(u, g)| Some((u.trim().parse().ok()?, g.trim().parse().ok()?)));
    parsed.with_context(|| format!("{ENV_SECRETS_OWNER} must be uid:gid, got {s:?}"))
}

/// Writes every file of `bundle` into `dir` (created, mode 0700) with mode 0400, each through a temporary
/// name and a rename so a reader never sees half a key. Nothing is written unless the whole bundle
/// parses.
pub fn unpack(bundle: &str, dir: &Path, owner: Option<(u32, u32)>) -> Result<Vec<String>> {
    let files: BTreeMap<String, String> = serde_json::from_str(bundle).with_context(|| {
        format!("{ENV_SECRET_BUNDLE} is not a JSON object of file name to base64 contents")
    })?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut decoded = Vec::with_capacity(files.len());
    for (name, value) in &files {
        if name.is_empty()
            || name == "."
            || name == ".."
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        {
            bail!("{ENV_SECRET_BUNDLE}: file name {name:?} must be [-._a-zA-Z0-9], not . or ..");
        }
        let bytes = b64
            .decode(value)
            .with_context(|| format!("{ENV_SECRET_BUNDLE}: {name} is not base64"))?;
        decoded.push((name.clone(), bytes));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 0700 {}", dir.display()))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .with_context(|| format!("chown {uid}:{gid} {}", dir.display()))?;
    }
    for (name, bytes) in &decoded {
        let tmp = dir.join(format!(".{name}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))
                .with_context(|| format!("chown {uid}:{gid} {}", tmp.display()))?;
        }
        let path = dir.join(name);
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    }
    Ok(decoded.into_iter().map(|(n, _)| n).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_each_file_private_and_refuses_bad_bundles() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("secrets");
        let bundle = r#"{"ca.pem":"Q0E=","key.pem":"S0VZ"}"#;
        let names = unpack(bundle, &target, None).unwrap();
        assert_eq!(names, ["ca.pem", "key.pem"]);
        assert_eq!(std::fs::read(target.join("key.pem")).unwrap(), b"KEY");
        assert_eq!(std::fs::read(target.join("ca.pem")).unwrap(), b"CA");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&target.join("key.pem")), 0o400);
        assert_eq!(mode(&target), 0o700);

        let empty = dir.path().join("never");
        for (bad, needle) in [
            ("not json", "not a JSON object"),
            (r#"{"../key":"S0VZ"}"#, "\"../key\""),
            (r#"{"a":"S0VZ","b":"%%%"}"#, "b is not base64"),
        ] {
            let err = format!("{:#}", unpack(bad, &empty, None).unwrap_err());
            assert!(err.contains(needle), "{err}");
            assert!(
                !empty.exists(),
                "a refused bundle wrote {}",
                empty.display()
            );
        }
        assert!(parse_owner("65532:65532").is_ok());
        assert!(parse_owner("nobody").is_err());
    }
}
