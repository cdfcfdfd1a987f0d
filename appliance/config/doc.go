// Package config reads fabricbridge's YAML configuration.
//
// The file is decoded from a yaml.Node tree by hand rather than with struct
// unmarshalling, so that every problem — a syntax error, an unknown or
// repeated field, a value of the wrong kind, a reference to an application
// or ingest ring that does not exist, a duplicate rule id — is reported with
// the file, the line and column, and the dotted path of the field
// (rules[2].match.dst_port), and all problems of a file are reported at
// once. Unknown fields are errors: a misspelt field must never silently
// fall back to a default.
//
// The input is bounded (see MaxFileSize and the constants beside it): a
// file is one document of UTF-8 text, of limited size, nesting, value
// length and alias expansion, so that a hostile file costs milliseconds
// and is refused with located, short messages.
//
// configs/README.md is the reference of every field; configs/*.yaml are
// examples that the tests check.
package config
