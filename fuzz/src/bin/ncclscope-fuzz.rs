//! AFL++ driver: `ncclscope-fuzz TARGET` runs one target under `cargo afl fuzz`;
//! `ncclscope-fuzz --seeds TARGET DIR` writes the target's starting inputs into DIR.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, target, dir] = args.as_slice()
        && flag == "--seeds"
    {
        let dir = std::path::Path::new(dir);
        std::fs::create_dir_all(dir).expect("seed directory");
        for (i, seed) in ncclscope_fuzz::seeds(target).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), seed).expect("seed file");
        }
        return;
    }
    let Some(run) = args.first().and_then(|t| ncclscope_fuzz::target(t)) else {
        eprintln!(
            "usage: ncclscope-fuzz TARGET | --seeds TARGET DIR; targets: {:?}",
            ncclscope_fuzz::TARGETS.map(|t| t.0)
        );
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| run(data));
}
