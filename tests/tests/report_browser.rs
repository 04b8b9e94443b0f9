//! The report as a browser shows it: a finished elastic job's `report.html` rendered by headless Chromium.
//! The screenshot is not blank and shows the plots' colours, the page logs no error, and every plot
//! section has its SVG. Skips when Chromium is absent; `PHYSALIA_REQUIRE_CHROMIUM=1` (set by `.ci/run`
//! after installing it) makes that a failure.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tempfile::TempDir;

const JOB: &str = "\
name: shot
dataset:
  synth: {kind: sbm, nodes: 3000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}
model: {kind: gcn, layers: 2, hidden: 16}
train: {epochs: 6, seed: 0}
output: {dir: jobs}
scaling:
  min_workers: 1
  max_workers: 2
  cooldown_epochs: 0
  rules:
    - name: two-at-3
      when: epoch == 3
      then: {set_workers: 2}
";

fn chromium() -> Option<PathBuf> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            && out.status.success()
        {
            return Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    if std::env::var("PHYSALIA_REQUIRE_CHROMIUM").as_deref() == Ok("1") {
        panic!("PHYSALIA_REQUIRE_CHROMIUM=1 but no chromium is installed");
    }
    eprintln!("skipping: chromium is not installed");
    None
}

/// The pixels of an 8-bit RGB or RGBA PNG, as RGB.
fn decode_png(bytes: &[u8]) -> (usize, usize, Vec<[u8; 3]>) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let (mut i, mut w, mut h, mut channels) = (8, 0, 0, 0);
    let mut idat = Vec::new();
    while i + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap()) as usize;
        let kind = &bytes[i + 4..i + 8];
        let data = &bytes[i + 8..i + 8 + len];
        match kind {
            b"IHDR" => {
                w = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                h = u32::from_be_bytes(data[4..8].try_into().unwrap()) as usize;
                assert_eq!(data[8], 8, "bit depth");
                channels = match data[9] {
                    2 => 3,
                    6 => 4,
                    c => panic!("colour type {c}"),
                };
                assert_eq!(data[12], 0, "interlaced");
            }
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        i += 12 + len;
    }
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&idat[..])
        .read_to_end(&mut raw)
        .unwrap();
    let stride = w * channels;
    assert_eq!(raw.len(), h * (stride + 1));
    let mut img = vec![0u8; h * stride];
    for y in 0..h {
        let filter = raw[y * (stride + 1)];
        let line = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        for x in 0..stride {
            let a = if x >= channels {
                img[y * stride + x - channels]
            } else {
                0
            } as i32;
            let b = if y > 0 { img[(y - 1) * stride + x] } else { 0 } as i32;
            let c = if x >= channels && y > 0 {
                img[(y - 1) * stride + x - channels]
            } else {
                0
            } as i32;
            let pred = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => (a + b) / 2,
                4 => {
                    let p = a + b - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - b).abs(), (p - c).abs());
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => panic!("filter {f}"),
            };
            img[y * stride + x] = (line[x] as i32 + pred) as u8;
        }
    }
    let px = img.chunks(channels).map(|p| [p[0], p[1], p[2]]).collect();
    (w, h, px)
}

fn finished_job(cwd: &Path) -> PathBuf {
    std::fs::write(cwd.join("job.yaml"), JOB).unwrap();
    let out = Command::new(physalia_tests::physalia_bin())
        .current_dir(cwd)
        .args(["submit", "job.yaml", "-q", "--output", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    cwd.join(v["job_dir"].as_str().unwrap())
}

#[test]
fn the_report_renders_in_chromium_with_every_plot() {
    let Some(chromium) = chromium() else { return };
    let t = TempDir::new().unwrap();
    let dir = finished_job(t.path());
    let report = std::path::absolute(dir.join("report.html")).unwrap();
    let html = std::fs::read_to_string(&report).unwrap();
    let url = format!("file://{}", report.display());
    let browser = |extra: &[&str]| {
        let out = Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--enable-logging=stderr",
                "--v=0",
                &format!("--user-data-dir={}", t.path().join("profile").display()),
            ])
            .args(extra)
            .arg(&url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "chromium failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    };
    // the page as the browser built it: every plot section has its SVG, nothing says "(no data)"
    let out = browser(&["--dump-dom"]);
    let dom = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for bad in ["Uncaught", "CONSOLE(", "Refused to"] {
        assert!(!stderr.contains(bad), "the page logged an error: {stderr}");
    }
    let plots = [
        "Loss against training time",
        "Accuracy against training time",
        "Workers per epoch",
        "Where each epoch's time goes",
        "Bytes exchanged per epoch",
        "Cost over time",
    ];
    let sections: Vec<&str> = dom.split("<h2>").skip(1).collect();
    for p in plots {
        let s = sections
            .iter()
            .find(|s| s.starts_with(p))
            .unwrap_or_else(|| panic!("no section `{p}` in the page"));
        assert!(s.contains("<svg"), "section `{p}` has no SVG");
    }
    assert_eq!(dom.matches("<svg").count(), plots.len(), "{dom}");
    assert!(!dom.contains("(no data)"));
    // the planner's prediction sits beside the measurement
    assert!(html.contains("planner's prediction"), "{html}");
    // a screenshot: not blank, with the plots' line and bar colours
    let png = t.path().join("report.png");
    browser(&[
        &format!("--screenshot={}", png.display()),
        "--window-size=1000,2600",
    ]);
    let (w, h, px) = decode_png(&std::fs::read(&png).unwrap());
    assert_eq!((w, h), (1000, 2600));
    let background = px[0];
    let drawn = px.iter().filter(|p| **p != background).count();
    assert!(
        drawn > px.len() / 50,
        "the screenshot is nearly blank: {drawn} of {} pixels drawn",
        px.len()
    );
    for (name, rgb) in [
        ("blue (#1f77b4)", [0x1f, 0x77, 0xb4]),
        ("red (#d62728)", [0xd6, 0x27, 0x28]),
    ] {
        assert!(px.contains(&rgb), "no {name} pixel in the screenshot");
    }
    if let Ok(keep) = std::env::var("PHYSALIA_KEEP_SCREENSHOT") {
        std::fs::copy(&png, keep).unwrap();
    }
}
