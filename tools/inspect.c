/* placeholder until the map layer lands; replaced in this session */
#include "tools/commands.h"
int stepq_tool_inspect(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return 1;
}
