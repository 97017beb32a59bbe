# Writes a C source that holds a file's bytes as an array, so a page can be
# compiled into the binary without xxd:
#   cmake -DINPUT=in.html -DOUTPUT=out.c -DSYMBOL=name -P embed_file.cmake
# defines `const unsigned char name[]` (NUL-terminated, for convenience) and
# `const size_t name_len` (the file's size, without the NUL).
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" n_hex)
math(EXPR n_bytes "${n_hex} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n" body "${body}")
file(WRITE "${OUTPUT}"
  "/* generated from ${INPUT} by cmake/embed_file.cmake; do not edit */\n"
  "#include <stddef.h>\n"
  "const unsigned char ${SYMBOL}[] = {\n${body}0x00};\n"
  "const size_t ${SYMBOL}_len = ${n_bytes};\n")
