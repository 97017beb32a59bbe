/* commands.h - the subcommands of the `ember` program.
 *
 * Each subcommand lives in its own cmd_<name>.c, receives argv starting at
 * its own name (argv[0] == "run"), prints its own usage on bad arguments and
 * returns the process exit status (0 ok, 1 failure, 2 usage error). */
#ifndef EMBER_CLI_COMMANDS_H
#define EMBER_CLI_COMMANDS_H

int cmd_run(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_mkmodel(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_serve(int argc, char **argv);

#endif
