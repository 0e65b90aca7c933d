//! `ncclscope reference config|metrics`: the configuration or metrics reference as Markdown, from
//! the code (docs/configuration.md and docs/metrics.md are this output).

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum Page {
    /// Every configuration key: variable, default, meaning.
    Config,
    /// Every metric family: type, unit, labels, meaning.
    Metrics,
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(value_enum)]
    pub page: Page,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    print!(
        "{}",
        match args.page {
            Page::Config => crate::reference::config_markdown(),
            Page::Metrics => crate::reference::metrics_markdown(),
        }
    );
    Ok(())
}
