//! infra/azure applies on a subscription as written (issue 30). Its job store's account has shared keys
//! off, and the azurerm provider reaches a storage data plane with the account key unless told
//! otherwise, which Azure then refuses: `terraform apply` fails with 403 KeyBasedAuthenticationNotPermitted
//! (terraform-provider-azurerm#27752). Terraform cannot plan here (no provider, no network), so the test
//! reads the configuration: every account without shared keys comes with the provider's
//! `storage_use_azuread = true` and `features { storage { data_plane_available = false } }` (available
//! from 4.9, so the version constraint must start there), no storage account uses what needs its data
//! plane, and the container is made through Resource Manager (`storage_account_id`). Where `terraform` is
//! installed, the files are also checked to be formatted (`terraform fmt -check`, offline).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/azure")
}

/// Every `.tf` file of infra/azure, by name.
fn files() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tf"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// `text` without `#` and `//` comments (none of infra/azure's strings holds either).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| {
            let cut = [l.find('#'), l.find("//")].into_iter().flatten().min();
            cut.map_or(l, |i| &l[..i])
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The bodies of the blocks whose header (the text before their `{`) is `header`, e.g.
/// `provider "azurerm"`, `features`, `resource "azurerm_storage_account" "jobs"`.
fn blocks<'a>(text: &'a str, header: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find(header) {
        let start = from + at;
        from = start + header.len();
        let before_ok = start == 0 || text[..start].ends_with(|c: char| c.is_whitespace());
        let rest = &text[from..];
        let Some(open) = rest.find('{') else { break };
        if !before_ok || !rest[..open].trim().is_empty() {
            continue;
        }
        let body_start = from + open + 1;
        let mut depth = 1;
        let mut end = body_start;
        for (i, c) in text[body_start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = body_start + i;
                break;
            }
        }
        assert_eq!(depth, 0, "unbalanced braces after {header}");
        out.push(&text[body_start..end]);
    }
    out
}

/// The value of the attribute `name` set directly in `body` (not in a nested block), trimmed.
fn attribute<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    let mut depth = 0;
    for line in body.lines() {
        let t = line.trim();
        if depth == 0
            && let Some((k, v)) = t.split_once('=')
            && k.trim() == name
        {
            return Some(v.trim());
        }
        depth += t.matches('{').count() as i32 - t.matches('}').count() as i32;
    }
    None
}

/// Issue 30 (terraform-provider-azurerm#27752): an account with shared keys off is made and read by a
/// provider that never uses its key.
#[test]
fn issue_30_the_job_store_account_applies_with_shared_keys_off() {
    let all: String = files()
        .iter()
        .map(|(_, t)| code(t))
        .collect::<Vec<_>>()
        .join("\n");
    let accounts = blocks(&all, "resource \"azurerm_storage_account\" \"jobs\"");
    assert_eq!(
        accounts.len(),
        1,
        "infra/azure makes the job store's account"
    );
    let keyless = accounts
        .iter()
        .any(|a| attribute(a, "shared_access_key_enabled") == Some("false"));
    assert!(
        keyless,
        "the job store's account keeps shared keys off: every access is an Entra ID token"
    );

    let providers = blocks(&all, "provider \"azurerm\"");
    assert_eq!(providers.len(), 1, "one azurerm provider block");
    let provider = providers[0];
    assert_eq!(
        attribute(provider, "storage_use_azuread"),
        Some("true"),
        "shared keys off needs storage_use_azuread = true in provider \"azurerm\":\n{provider}"
    );
    let features = blocks(provider, "features");
    let storage: Vec<&str> = features.iter().flat_map(|f| blocks(f, "storage")).collect();
    assert_eq!(
        storage
            .iter()
            .filter_map(|s| attribute(s, "data_plane_available"))
            .collect::<Vec<_>>(),
        ["false"],
        "the account is made through Resource Manager only: features.storage.data_plane_available = false"
    );
    // which the provider documents for accounts that use neither of these
    for account in &accounts {
        for needs_data_plane in ["queue_properties", "static_website"] {
            assert!(
                blocks(account, needs_data_plane).is_empty(),
                "{needs_data_plane} needs the storage data plane"
            );
        }
    }
    // a container through Resource Manager, not the data plane (`storage_account_name`)
    for container in blocks(&all, "resource \"azurerm_storage_container\"") {
        assert!(
            attribute(container, "storage_account_id").is_some()
                && attribute(container, "storage_account_name").is_none(),
            "{container}"
        );
    }

    // data_plane_available came in 4.9.0; the constraint must not admit an older provider
    let required = blocks(&all, "required_providers");
    let azurerm = required
        .iter()
        .flat_map(|r| blocks(r, "azurerm ="))
        .next()
        .expect("required_providers names azurerm");
    let version = attribute(azurerm, "version").expect("a version constraint");
    let v = version.trim_matches('"');
    let min = v
        .trim_start_matches(['~', '>', '=', ' '])
        .split('.')
        .map(|p| p.parse::<u32>().unwrap())
        .collect::<Vec<_>>();
    assert!(
        (v.starts_with("~>") || v.starts_with(">=")) && min >= vec![4, 9] && min < vec![5],
        "azurerm {version}: data_plane_available needs 4.9 or later within 4.x"
    );
}

/// The configuration is as `terraform fmt` writes it (offline; skipped without terraform).
#[test]
fn infra_azure_is_formatted() {
    let Ok(out) = std::process::Command::new("terraform")
        .args(["fmt", "-check", "-diff"])
        .arg(root())
        .output()
    else {
        eprintln!("skipping: no terraform on PATH");
        return;
    };
    assert!(
        out.status.success(),
        "terraform fmt -check infra/azure:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
