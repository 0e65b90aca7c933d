//! How the commands print an error.

/// An error as the commands print it: its message on one line, then one line per cause. Returning
/// it from `main` would print anyhow's debug form, with a 30-40 frame backtrace wherever
/// RUST_BACKTRACE=1 is set (common on cluster images); that form only with `--debug`.
pub fn report(e: &anyhow::Error, debug: bool) -> String {
    let mut out = format!("error: {e}\n");
    let mut last = e.to_string();
    for cause in e.chain().skip(1).map(|c| c.to_string()) {
        // Some errors repeat their source's message (an io::Error wrapped once more).
        if cause != last {
            out.push_str(&format!("  caused by: {cause}\n"));
        }
        last = cause;
    }
    if debug {
        out.push_str(&format!("\n{e:?}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    #[test]
    fn an_error_is_a_line_and_its_causes_without_a_backtrace() {
        let e = Err::<(), _>(std::io::Error::other("connection refused"))
            .context("connecting to /run/ncclscope/api.sock")
            .unwrap_err();
        assert_eq!(
            super::report(&e, false),
            "error: connecting to /run/ncclscope/api.sock\n  caused by: connection refused\n"
        );
        assert!(super::report(&e, true).contains("Caused by:"));
    }
}
