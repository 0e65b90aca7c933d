//! The operator's pages as a reader meets them: the README opens with the three quick starts, each
//! ending with how to verify it, within its first 80 lines; every relative link of the README and of
//! docs/ names a file that exists (the README's text moved to docs/, and the package ships both).

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_readme_opens_with_three_quick_starts_each_verified() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    // The two commands .ci/run and a newcomer start with.
    assert!(
        lines[..12]
            .iter()
            .any(|l| l.starts_with("cargo run --release --bin ncclscope -- demo "))
    );
    assert!(
        lines[..12]
            .iter()
            .any(|l| l.starts_with("scripts/test.sh "))
    );
    let starts: Vec<usize> = (lines.iter().enumerate())
        .filter(|(_, l)| l.starts_with("## Quick start: "))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(starts.len(), 3, "package, Kubernetes, Slurm");
    for (n, &at) in starts.iter().enumerate() {
        let end = (lines.iter().enumerate().skip(at + 1))
            .find(|(_, l)| l.starts_with("## "))
            .map_or(lines.len(), |(i, _)| i);
        assert!(end <= 80, "{} ends on line {end}", lines[at]);
        let section = lines[at..end].join("\n");
        assert!(
            section.contains("\nVerify: "),
            "quick start {n} says how to verify it"
        );
    }
}

#[test]
fn every_relative_link_of_the_readme_and_docs_resolves() {
    let mut pages = vec![repo().join("README.md")];
    for e in std::fs::read_dir(repo().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for (i, _) in text.match_indices("](") {
            let target = text[i + 2..].split(')').next().unwrap_or("");
            let path = target.split('#').next().unwrap();
            if path.is_empty() || path.contains("://") {
                continue;
            }
            if !page.parent().unwrap().join(path).exists() {
                broken.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}
