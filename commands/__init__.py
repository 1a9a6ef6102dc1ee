"""The `hsx` subcommands: the parser and dispatch, each service's config built and run
(`services`, and `child` for what `hsx up` starts), `up`, `status`, `verify`, `dead`, `jobs`,
`index`, `sync`, `export`, the demo's pieces. Commands may import services; nothing imports a
command."""
