//! `hcp-sense mcp`: the MCP door over standard input and output, for a harness that starts its tools as processes; a client of a running server, as `explain` is.
use rmcp::ServiceExt;

use super::ServerArgs;

/// Most live subscriptions of the one client of `hcp-sense mcp`.
const MAX_SUBSCRIPTIONS: usize = 16;

#[derive(Debug, clap::Args)]
pub struct McpArgs {
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Serves MCP on standard input and output until the client closes them. Every call goes
/// to the server with `--token`; standard output carries MCP messages only, logs go to
/// standard error.
pub async fn run(args: McpArgs) -> anyhow::Result<()> {
    let server = args.server.connect()?;
    // One client on standard input: the server's own stream caps bound it.
    let caps = crate::mcp::SubscriptionCaps {
        total: MAX_SUBSCRIPTIONS,
        per_caller: MAX_SUBSCRIPTIONS,
    };
    let door = crate::mcp::Door::new(
        crate::mcp::call::remote(server.channel.clone()),
        args.server.token.as_deref(),
        caps,
    )?;
    let running = door.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}
