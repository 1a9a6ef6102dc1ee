"""The `hsx` subcommands that are not a service: the parser and dispatch, `up`, `status`, `verify`,
`dead`, `jobs`, `index`, `sync`, the demo's pieces. Commands may import services; nothing imports a
command."""
