//! The `hcp-sense` command: serve, migrate, check-config, pipe, explain, lint.
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hcp_sense::app::{shutdown_signal, App};
use hcp_sense::config::{Config, FileAuth, LogFormat, Logging, StoreConfig};
use hcp_sense::domain::pack::{lint, parse_manifest_text, Severity};
use hcp_sense::store::Store;
use hcp_sense::telemetry::init_logging;

/// jemalloc, configured in `.cargo/config.toml` to hand memory freed after a burst of
/// connections or streams back to the system within about a second; glibc's allocator keeps
/// it, and the resident size stays where the burst took it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// hcp-sense decides, clause by clause of HCP §7, whether a pack's trigger may reach a sink.
#[derive(Parser)]
#[command(version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Options of `serve`, the default command.
    #[command(flatten)]
    serve: Config,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the gRPC API (the default).
    Serve(Box<Config>),
    /// Apply or inspect the schema migrations.
    Migrate {
        /// `up` applies every pending migration; `down` reverts the latest applied one; `status`
        /// lists them.
        #[arg(value_enum, default_value = "up")]
        action: MigrateAction,
        #[command(flatten)]
        database: StoreConfig,
        #[command(flatten)]
        logging: Logging,
    },
    /// Check a serve configuration (file, environment and flags, as `serve` takes them) and
    /// exit: 0 if the server would start with it, 1 naming what is wrong (2, as for every
    /// command, when an option's value cannot be read at all).
    CheckConfig(Box<Config>),
    /// Run a `sense_only` pack's command and deliver each JSON line it prints as a trigger
    /// (`{"ref": …, "payload": {…}}`, optionally `trigger_id`, `project`, `land`). A
    /// malformed line is reported on stderr with its number; exits with the command's code.
    Pipe(hcp_sense::cli::pipe::PipeArgs),
    /// Ask a server what it would decide on a trigger now, and why: every check in the
    /// decision order with what it read. Records nothing.
    Explain(hcp_sense::cli::explain_trigger::ExplainArgs),
    /// Ask a server's decision log what it decided for a trigger then, and why: the check
    /// that decided it and what it read (`--pack` and `--trigger-id`, or a `--principal`'s
    /// newest, `--since` an age).
    Why(hcp_sense::cli::why::WhyArgs),
    /// Serve the MCP door on standard input and output (for a harness that starts its MCP
    /// servers as processes): a client of the server at `--server`, with `--token`.
    Mcp(hcp_sense::cli::mcp::McpArgs),
    /// Lint a pack manifest (JSON or YAML; `-` reads standard input). Exits 1 on any error.
    Lint {
        /// The manifest file.
        manifest: PathBuf,
    },
}

#[derive(clap::ValueEnum, Clone, Copy)]
enum MigrateAction {
    /// Apply every pending migration (the default).
    Up,
    /// Revert the latest applied migration (one step; run again for more).
    Down,
    /// List the migrations and whether each is applied.
    Status,
}

fn main() -> ExitCode {
    let (cli, auth) = match hcp_sense::config::parse::<Cli>(std::env::args_os()) {
        Ok(parsed) => parsed,
        Err(e) => match e.downcast::<clap::Error>() {
            // Help, version and usage errors print as clap prints them.
            Ok(e) => e.exit(),
            Err(e) => {
                eprintln!("error: {e:#}");
                return ExitCode::FAILURE;
            }
        },
    };
    match cli.command {
        Some(Cmd::Lint { manifest }) => lint_file(&manifest),
        Some(Cmd::Pipe(args)) => pipe(args),
        Some(Cmd::Explain(args)) => explain(args),
        Some(Cmd::Why(args)) => printed(hcp_sense::cli::why::run(args)),
        Some(Cmd::Mcp(args)) => mcp(args),
        Some(Cmd::Migrate {
            action,
            database,
            logging,
        }) => run(migrate(action, database, logging.log_format)),
        Some(Cmd::Serve(config)) => run(serve(*config, auth)),
        Some(Cmd::CheckConfig(config)) => match config.checked(auth) {
            Ok(_) => {
                println!("configuration ok");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
        None => run(serve(cli.serve, auth)),
    }
}

fn pipe(args: hcp_sense::cli::pipe::PipeArgs) -> ExitCode {
    let rt = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(hcp_sense::cli::pipe::run(args)) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn mcp(args: hcp_sense::cli::mcp::McpArgs) -> ExitCode {
    let rt = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(hcp_sense::cli::mcp::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn explain(args: hcp_sense::cli::explain_trigger::ExplainArgs) -> ExitCode {
    printed(hcp_sense::cli::explain_trigger::run(args))
}

/// Runs a client command and prints its text; its error on stderr, exiting 1.
fn printed(cmd: impl std::future::Future<Output = anyhow::Result<String>>) -> ExitCode {
    let rt = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(cmd) {
        Ok(text) => {
            println!("{}", text.trim_end());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A runtime from `builder`, or the exit code of a process that could not start one.
fn runtime(mut builder: tokio::runtime::Builder) -> Result<tokio::runtime::Runtime, ExitCode> {
    builder.enable_all().build().map_err(|e| {
        eprintln!("error: starting the runtime: {e}");
        ExitCode::FAILURE
    })
}

fn run(f: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let rt = match runtime(tokio::runtime::Builder::new_multi_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let result = rt.block_on(f);
    // Work still stuck on an unreachable store (a pool connection, a record write) must not
    // keep the process alive past its shutdown.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config, auth: FileAuth) -> anyhow::Result<()> {
    let config = config.checked(auth)?;
    let telemetry =
        hcp_sense::telemetry::init(config.logging.log_format, config.sample_drop_decisions);
    tracing::info!(
        listen = %config.listen,
        store = ?hcp_sense::store::Engine::of_url(secrecy::ExposeSecret::expose_secret(&config.database.url)),
        "starting hcp-sense {}",
        env!("CARGO_PKG_VERSION")
    );
    let app = App::build(config).await?;
    let result = app.run_until(shutdown_signal()).await;
    // Export the spans still buffered before the process ends.
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    result
}

async fn migrate(
    action: MigrateAction,
    database: StoreConfig,
    log_format: LogFormat,
) -> anyhow::Result<()> {
    init_logging(log_format);
    let store = Store::connect(&database).await?;
    match action {
        MigrateAction::Up => store.migrate_up().await?,
        MigrateAction::Down => match store.migrate_down_one().await? {
            Some(name) => tracing::info!(migration = %name, "reverted"),
            None => tracing::warn!("no migration is applied; nothing to revert"),
        },
        MigrateAction::Status => {}
    }
    for m in store.migration_status().await? {
        let state = match (m.applied, m.known) {
            (true, true) => "applied",
            (true, false) => "applied-by-newer-release",
            (false, _) => "pending",
        };
        if log_format == LogFormat::Json {
            // One stream of JSON lines for log collectors.
            tracing::info!(migration = %m.name, state, "migration");
        } else {
            println!("{state}\t{}", m.name);
        }
    }
    store.close().await;
    Ok(())
}

fn lint_file(path: &PathBuf) -> ExitCode {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: reading {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let value = match parse_manifest_text(&text) {
        Ok(v) => v,
        Err(e) => {
            println!("error[s7_1_1]: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = lint(&value);
    for f in &report.findings {
        let level = match f.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let at = if f.field.is_empty() {
            "manifest"
        } else {
            &f.field
        };
        println!("{level}[{}] {at}: {}", f.rule, f.message);
    }
    let errors = report.errors().count();
    let warnings = report.findings.len() - errors;
    println!(
        "{}: {errors} error(s), {warnings} warning(s)",
        report.pack_id.as_deref().unwrap_or("manifest")
    );
    if errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
